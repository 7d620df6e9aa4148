"""dflash-plot: a PNG of a run's training curves, for people who would rather look than read.

Panels: loss, acc, streak, lr and throughput against step, and the latest per-position
accuracy (from `train.step` and `train.position_acc` log lines of consumer rank 0). A
resumed run is plotted with its lineage: each earlier run's steps up to where the next one
took over (run.json `parent_run`); a missing earlier run is named in the title.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from dflash.runtime.command_line import command, fail, option, runs_dir_option
from dflash.runtime.run import resolve_run

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


def lineage(run_dir: Path) -> tuple[list[Path], str | None]:
    """(the runs of this run's lineage, oldest first, ending with it; the ID of an earlier
    run that is named by run.json `parent_run` but not on disk, or None)."""
    runs, seen, cur = [run_dir], {run_dir.name}, run_dir
    while True:
        try:
            parent = json.loads((cur / "run.json").read_text()).get("parent_run")
        except (OSError, ValueError):
            parent = None
        if not isinstance(parent, str) or not parent or parent in seen:
            return runs[::-1], None
        cur = run_dir.parent / parent
        if not (cur / "logs").is_dir():
            return runs[::-1], parent
        seen.add(parent)
        runs.append(cur)


def lineage_series(run_dir: Path) -> tuple[dict[str, list], list | None, list[Path], str | None]:
    """training_series over the lineage: an earlier run's steps from the step its successor
    began at on are left out (they were trained again there, from the committed checkpoint)."""
    runs, missing = lineage(run_dir)
    parts = [training_series(r) for r in runs]
    series: dict[str, list] = {k: [] for k in parts[-1][0]}
    position_acc = None
    for i, (s, pos) in enumerate(parts):
        nxt = next((p[0]["step"][0] for p in parts[i + 1:] if p[0]["step"]), None)
        keep = [j for j, step in enumerate(s["step"]) if nxt is None or step < nxt]
        for k in series:
            series[k] += [s[k][j] for j in keep]
        position_acc = pos or position_acc
    return series, position_acc, runs, missing


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
    else:  # an empty panel looked like a bug
        ax.text(0.5, 0.5, f"no train.position_acc line yet:\nconsumers log it every --log-position-every\n"
                f"steps (default 100); {len(series['step'])} steps so far", ha="center", va="center",
                transform=ax.transAxes, fontsize=9, color="0.4")
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
    series, position_acc, runs, missing = lineage_series(run_dir)
    if not series["step"]:
        fail(f"run {run_dir.name} has no train.step lines yet ({run_dir / 'logs'})")
    out_path = Path(out) if out else run_dir / "plot.png"
    title = f"run {run_dir.name}: steps {series['step'][0]}-{series['step'][-1]}"
    if len(runs) > 1:
        title += f" (resumed: also runs {', '.join(r.name for r in runs[:-1])})"
    if missing:
        title += f"; earlier run {missing} not found, its steps not shown"
    render(series, position_acc, out_path, title)
    click.echo(f"wrote {out_path} (run {run_dir.name}, {len(series['step'])} steps"
               + (f" from {len(runs)} runs of its lineage" if len(runs) > 1 else "")
               + (f"; earlier run {missing} not found: its steps are not shown" if missing else "") + ")")


if __name__ == "__main__":
    main()
