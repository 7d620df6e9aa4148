"""Metrics for the tools of the field (issue 20): `--tensorboard DIR` writes TensorBoard
event files from log lines, named as the JSON fields under the event's name (consumer rank
0's `train.step/loss`, `train.step/tokens_per_s` at each step; the broker's
`broker.progress/samples_per_s`, `broker.progress/queue_bytes` at each tick, its step the
seconds since the broker started): units are in the names, one scalar per numeric field.
The JSON lines stay the record; this is a view of them.
TensorBoard is an optional extra: `pip install 'dflash-pipeline[tensorboard]'`."""

from __future__ import annotations

from pathlib import Path

def scalars(line: dict, event: str = "train.step") -> dict[str, float]:
    """The numeric top-level fields of a log line as `<event>/<field>` (not `step`, `pid`, booleans)."""
    return {f"{event}/{k}": float(v) for k, v in line.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "pid")}


def require_tensorboard() -> None:
    """Raise ValueError saying how to install the extra, before anything starts."""
    try:
        import tensorboard  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--tensorboard needs the tensorboard package: pip install 'dflash-pipeline[tensorboard]' "
                         f"({e})") from None


class TensorBoardSink:
    """One SummaryWriter in DIR/<run_id>; flushed every step so a live TensorBoard sees it."""

    def __init__(self, root: str | Path, run_id: str, event: str = "train.step"):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's writer needs the tensorboard package
            raise ValueError("--tensorboard needs the tensorboard package: pip install "
                             f"'dflash-pipeline[tensorboard]' ({e})") from None
        self.dir, self.event = Path(root) / run_id, event
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def __call__(self, step: int, line: dict) -> None:
        for tag, value in scalars(line, self.event).items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
