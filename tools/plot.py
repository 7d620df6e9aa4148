"""dflash-plot: a PNG of a run's training curves, for people who would rather look than read.

Panels: loss, acc, streak, lr and throughput against step, and the latest per-position
accuracy (from `train.step` and `train.position_acc` log lines of consumer rank 0).
"""

from __future__ import annotations

from pathlib import Path

import click

from dflash.protocol.config import command, fail, option, runs_dir_option
from dflash.protocol.run import resolve_run

from .runlogs import merged

PANELS = (("loss", "loss"), ("acc", "acc"), ("streak", "streak"), ("lr", "lr"),
          ("tokens_per_s", "throughput (tok/s)"))


def training_series(run_dir: Path) -> tuple[dict[str, list], list | None]:
    """(step-indexed series per metric, last per-position accuracy) from rank 0's lines."""
    series: dict[str, list] = {k: [] for k, _ in PANELS}
    series["step"] = []
    position_acc = None
    for ev in merged(run_dir):
        if ev.get("role") != "consumer" or ev.get("rank", 0) != 0:
            continue
        if ev.get("event") == "train.step" and isinstance(ev.get("step"), int):
            series["step"].append(ev["step"])
            for k, _ in PANELS:
                series[k].append(ev.get(k))
        elif ev.get("event") == "train.position_acc":
            position_acc = ev.get("acc_by_position")
    return series, position_acc


def render(series: dict, position_acc: list | None, out: Path, title: str, dpi: int = 100) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 3, figsize=(12, 6.75))
    for ax, (key, label) in zip(axes.flat, PANELS):
        pts = [(s, v) for s, v in zip(series["step"], series[key]) if isinstance(v, (int, float))]
        if pts:
            ax.plot(*zip(*pts), lw=1)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax = axes.flat[-1]
    if position_acc:
        positions = range(1, len(position_acc) + 1)
        ax.bar(positions, [0 if a is None else a for a in position_acc])  # None: no valid token there
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # positions are whole numbers
    ax.set_title("acc by block position (latest)")
    ax.set_xlabel("position k")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=dpi)
    plt.close(fig)


@command("PLOT")
@option("--run", "run_ref", default="latest", help="Run ID, run folder, or 'latest'.")
@runs_dir_option()
@option("--out", "-o", type=click.Path(dir_okay=False), default=None,
        help="PNG to write (default runs/<run_id>/plot.png).")
def main(run_ref, runs_dir, out):
    """Write a PNG (1200x675 px) of loss, acc, streak, lr and throughput against step, and
    the latest accuracy per block position, from the logs of consumer rank 0."""
    try:
        run_dir = resolve_run(run_ref, runs_dir)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    series, position_acc = training_series(run_dir)
    if not series["step"]:
        fail(f"run {run_dir.name} has no train.step lines yet ({run_dir / 'logs'})")
    out_path = Path(out) if out else run_dir / "plot.png"
    render(series, position_acc, out_path, f"run {run_dir.name}: steps {series['step'][0]}-{series['step'][-1]}")
    click.echo(f"wrote {out_path} (run {run_dir.name}, {len(series['step'])} steps)")


if __name__ == "__main__":
    main()
