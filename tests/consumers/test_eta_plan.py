"""A consumer's `train.step` ETA counts down to the broker's plan: under --time-budget the
planned samples, not every epoch of the dataset (issue 35: status and ETA speak against
the budget)."""

import pytest

from dflash.consumers.training.step_metrics import Meter

pytestmark = pytest.mark.unit


def eta(progress: dict) -> int | None:
    # a pace the assertions can count with: the meter has seen its samples over a round elapsed time
    return Meter(16, None, None, 0)._epoch_eta(50, 1000, 0.0, progress, 10.0, 5, 100.0)[1]


def test_the_eta_counts_down_to_the_planned_samples_of_a_budget():
    counts = {"n_samples": 8000, "samples_total": 160000, "samples_done": 49000}
    assert eta({**counts, "samples_planned": 50000}) == 100  # 1,000 left at 10/s: the budget's end
    assert eta(counts) == 11100  # a broker that sends no plan: every epoch


def test_without_a_plan_or_counts_there_is_no_eta():
    assert eta({}) is None
