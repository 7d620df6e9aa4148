"""The lr and noise schedules run over the planned samples (docs/TRAINING.md "Schedule"):
real dflash-consume runs on the local stream, one sample per step, so each step's lr can
be checked against the plan; a resumed run continues the same curve."""

import json
import math

import pytest
from click.testing import CliRunner

from tests.harness.tiny import MASK_ID
from dflash.consumers.process.consume_command import main
from dflash.consumers.training.train_config import Plan, choose_plan, lr_at
from dflash.consumers.training.config import TrainConfig

pytestmark = pytest.mark.unit

PEAK, MIN, NOISE = 1e-3, 1e-5, 0.1
PLANNED = 50  # samples: the warmup (4%) is the first 2


def _run(target_dir, runs, batches, *extra):
    args = ["--target", str(target_dir), "--runs-dir", str(runs), "--draft-layers", "1", "--target-layers", "1,2",
            "--block-size", "4", "--anchors", "4", "--mask-token-id", str(MASK_ID), "--synthetic-seq-len", "16",
            "--synthetic-seqs", "1", "--synthetic-batches", str(batches), "--instance", "sched",
            "--lr", str(PEAK), "--min-lr", str(MIN), "--feature-noise", str(NOISE), "--log-position-every", "0",
            *extra]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    run = (runs / "latest").resolve()
    return run, [json.loads(x) for x in (run / "logs" / "consumer-sched.jsonl").read_text().splitlines()]


def _expected(samples: int) -> float:
    p = samples / PLANNED
    if p < 0.04:
        return PEAK * p / 0.04
    return MIN + 0.5 * (1 + math.cos(math.pi * (p - 0.04) / 0.96)) * (PEAK - MIN)


def test_lr_warms_up_over_4_percent_of_the_planned_samples_and_ends_at_the_minimum(target_dir, tmp_path):
    run, events = _run(target_dir, tmp_path / "runs", PLANNED)  # no --total-samples: the stream's 50
    plans = [e for e in events if e["event"] == "train.schedule"]
    assert [(p["by"], p["length"], p["source"]) for p in plans] == [("samples", PLANNED, "stream")]
    lr = {e["step"]: e["lr"] for e in events if e["event"] == "train.step"}
    assert len(lr) == PLANNED
    assert lr[1] < PEAK and lr[1] == pytest.approx(PEAK / 2)  # 1 of the 2 warmup samples trained
    assert lr[2] == pytest.approx(PEAK)  # 4% of the planned samples: the peak
    assert all(lr[s] < lr[s - 1] for s in range(3, PLANNED + 1))  # cosine decay from there
    assert lr[PLANNED] == pytest.approx(MIN)  # the last planned sample is trained at the minimum
    noise = {e["step"]: e["noise"] for e in events if e["event"] == "train.step"}
    assert noise[1] == pytest.approx(NOISE) and noise[PLANNED] == pytest.approx(NOISE / PLANNED, abs=1e-5)
    state = json.loads((run / "checkpoints" / f"step-{PLANNED}" / "state.json").read_text())
    assert state["scheduler"]["planned_samples"] == PLANNED and state["scheduler"]["by"] == "samples"
    assert json.loads((run / "run.json").read_text())["config"]["train"]["total_samples"] is None


def test_a_resumed_run_continues_the_same_curve(target_dir, tmp_path):
    runs = tmp_path / "runs"
    first, a = _run(target_dir, runs, 20, "--total-samples", str(PLANNED), "--save-every", "20")
    # The resumed process's own stream holds 30 samples: the checkpoint's plan (50) still wins
    second, b = _run(target_dir, runs, 30, "--resume", str(first))
    lr = {e["step"]: e["lr"] for e in a + b if e["event"] == "train.step"}
    assert sorted(lr) == list(range(1, PLANNED + 1))
    for s, v in lr.items():
        assert v == pytest.approx(_expected(s), rel=1e-9), s
    assert [(p["source"], p["length"]) for p in b if p["event"] == "train.schedule"] == [("checkpoint", PLANNED)]


def test_plan_precedence_and_the_step_override():
    cfg = TrainConfig(total_samples=10)
    assert choose_plan(cfg, broker=99, checkpoint=7, stream=5) == Plan("samples", 10, "--total-samples")
    assert choose_plan(TrainConfig(), broker=99, checkpoint=7, stream=5).source == "broker"
    assert choose_plan(TrainConfig(), checkpoint=7, stream=5).source == "checkpoint"
    assert choose_plan(TrainConfig()) == Plan("constant", None, "none")
    assert lr_at(5, TrainConfig(lr=1.0), samples=5) == 1.0  # nothing planned: constant
    steps = TrainConfig(lr=1.0, total_steps=100, total_samples=10)  # --total-steps overrides
    assert choose_plan(steps).by == "steps" and lr_at(2, steps) == pytest.approx(0.5)


def test_a_plan_that_moves_keeps_the_lr_continuous_falling_and_ends_at_the_minimum():
    """--time-budget re-plans (broker/budget.py): the schedule goes on from where it was
    (Plan.moved_to), with no jump in the lr, never rising again once annealing began, and
    the last sample of the newest plan trained at min-lr."""
    cfg = TrainConfig(lr=PEAK, min_lr=MIN, warmup=0.04)
    plan = Plan("samples", 1000, "broker")
    moves = {30: 2000, 400: 900, 700: 760, 750: 1200}  # samples trained -> the broker's new plan
    lrs, samples = [], 0
    while samples < plan.length:
        if samples in moves:
            moved = plan.moved_to(Plan("samples", moves[samples], "broker"), samples)
            # the step after the move starts where the old plan was
            before = lr_at(1, cfg, samples, plan)
            assert lr_at(1, cfg, samples, moved) == pytest.approx(before, rel=1e-12)
            plan = moved
        samples += 1
        lrs.append(lr_at(samples, cfg, samples, plan))
    assert samples == 1200 and lrs[-1] == pytest.approx(MIN)
    steps = [b - a for a, b in zip(lrs, lrs[1:])]
    peak = lrs.index(max(lrs))
    assert all(d > 0 for d in steps[:peak]) and all(d <= 1e-15 for d in steps[peak:])
    assert max(abs(d) for d in steps) < PEAK / 20  # no jump anywhere (a warmup step is PEAK / 40 or less)
    # a plan moved to no more than what is trained is over: min-lr
    assert lr_at(1, cfg, 500, Plan("samples", 1000, "broker").moved_to(Plan("samples", 480, "broker"), 500)) == MIN
