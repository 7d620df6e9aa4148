"""Metrics sinks: `--tensorboard DIR` and `--wandb PROJECT` get one scalar per numeric field of a
log line, named `<event>/<field>` (e.g. `train.step/loss`). The JSON lines stay the record; both
are optional extras (`[tensorboard]`, `[wandb]`)."""

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


def require_wandb() -> None:
    try:
        import wandb  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--wandb needs the wandb package: pip install 'dflash-pipeline[wandb]' ({e})") from None


class WandbSink:
    """One W&B run per dflash run (and role): named `<run_id>-<role>`, files under run_dir."""

    def __init__(self, project: str, run_id: str, run_dir: str | Path, event: str, config: dict | None = None):
        require_wandb()
        import wandb

        self.event, self.last_step = event, -1
        role = event.split(".")[0]
        self.run = wandb.init(project=project, name=f"{run_id}-{role}", id=f"{run_id}-{role}".replace(":", "-"),
                              dir=str(run_dir), config=config or {}, group=run_id, job_type=role,
                              # hands off our stdout: it carries the JSON log lines
                              settings=wandb.Settings(silent=True, console="off"))

    def __call__(self, step: int, line: dict) -> None:
        # W&B merges two logs of one step, losing the first: a repeated step takes the next one
        self.last_step = step = max(step, self.last_step + 1)
        self.run.log(scalars(line, self.event), step=step)

    def close(self) -> None:
        self.run.finish()


class Sinks:
    """The sinks a command was asked for, called and closed together."""

    def __init__(self, sinks: list):
        self.sinks = [s for s in sinks if s is not None]

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def __call__(self, step: int, line: dict) -> None:
        for s in self.sinks:
            s(step, line)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def open_sinks(tensorboard: str | None, wandb_project: str | None, run_id: str, run_dir: str | Path,
               event: str) -> Sinks | None:
    sinks = Sinks([TensorBoardSink(tensorboard, run_id, event) if tensorboard else None,
                   WandbSink(wandb_project, run_id, run_dir, event) if wandb_project else None])
    return sinks or None
