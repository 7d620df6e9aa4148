"""Training metrics for the tools of the field (issue 20): `--tensorboard DIR` writes
TensorBoard event files from rank 0's `train.step` lines, with the same names as the JSON
fields (`train.step/loss`, `train.step/tokens_per_s`: units are in the names), one scalar
per numeric field, at the step. The JSON lines stay the record; this is a view of them.
TensorBoard is an optional extra: `pip install 'dflash-pipeline[tensorboard]'`."""

from __future__ import annotations

from pathlib import Path

PREFIX = "train.step/"


def scalars(line: dict) -> dict[str, float]:
    """The numeric top-level fields of a train.step line (not `step`, not booleans)."""
    return {PREFIX + k: float(v) for k, v in line.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "pid")}


class TensorBoardSink:
    """One SummaryWriter in DIR/<run_id>; flushed every step so a live TensorBoard sees it."""

    def __init__(self, root: str | Path, run_id: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's writer needs the tensorboard package
            raise ValueError(f"--tensorboard needs the tensorboard package: pip install "
                             f"'dflash-pipeline[tensorboard]' ({e})") from None
        self.dir = Path(root) / run_id
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def __call__(self, step: int, line: dict) -> None:
        for tag, value in scalars(line).items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
