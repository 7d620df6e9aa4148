"""Ops and host synchronisations a steady-state drafter step dispatches, on the CPU.

    PYTHONPATH=. python bench/step_ops.py --steps 4

Trains the real Trainer on a SmolLM2-shaped tiny target (tests/harness/step_ops.py) and
prints one JSON line: aten ops and sync-forcing calls per step in the training thread
(the optimizer step left out), which of them, and every step's loss (the trajectory to
compare before and after a change of the step).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click

from tests.harness.step_ops import count_training


@click.command()
@click.option("--steps", default=4, type=int, help="Steady-state steps to count (after 2 warm-up steps).")
@click.option("--no-stage", is_flag=True, help="Without the staging thread: the step plans its batch itself.")
def main(steps: int, no_stage: bool) -> None:
    """Count what a training step dispatches."""
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(count_training(Path(tmp) / "target", steps=steps, stage_batches=not no_stage)))


if __name__ == "__main__":
    main()
