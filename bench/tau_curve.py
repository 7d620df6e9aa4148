"""Held-out tau against samples trained, from a run's live evaluation (`dflash-consume
--eval-every N --eval-prompts FILE`): a PNG and the points as JSON.

    python bench/tau_curve.py --run runs/latest [--run LABEL=runs/OTHER ...] --out tau.png --json tau.json

Reads the consumers' logs of each run (`RUN/logs/consumer-*.jsonl`, docs/LOGS.md): every
`eval.tau` (real speculative decoding of the held-out prompts: tau, pooled tau, speedup,
mismatches) and `eval.step` (simulated tau on the batch about to be trained), each with the
samples its weights had trained (`samples`, all ranks). The plot has one solid line of real
tau per run, and its simulated tau dashed, against samples trained. The JSON lists the
points in order of samples. A run with no `eval.tau` is an error (it was not run with
`--eval-prompts`), as is an event without `samples` (logs of an older consumer).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from dflash.tools.runlogs import read_lines

TAU_KEYS = ("step", "samples", "tau", "tau_pooled", "acceptance_rate", "speedup", "prompts", "new_tokens", "tie_flips")
SIM_KEYS = ("step", "samples", "tau", "acc", "loss", "epoch", "unseen_frac")


class CurveError(ValueError):
    """A run's logs hold no curve to draw."""


def run_points(run_dir: Path) -> dict:
    """{"tau": [...], "simulated": [...]} of the run in `run_dir`, in order of samples."""
    files = sorted((run_dir / "logs").glob("consumer-*.jsonl"))
    if not files:
        raise CurveError(f"{run_dir}: no consumer logs (logs/consumer-*.jsonl)")
    tau, sim = [], []
    for f in files:
        for ev in read_lines(f):
            kind = ev.get("event")
            if kind not in ("eval.tau", "eval.step") or "batches" in ev:  # `batches`: the library hook's form
                continue
            if ev.get("samples") is None:
                raise CurveError(f"{f}: {kind} at step {ev.get('step')} has no `samples` (a consumer older than "
                                 "the field): cannot place it on the samples axis")
            if kind == "eval.tau":
                tau.append({k: ev.get(k) for k in TAU_KEYS} | {"mismatches": len(ev.get("mismatches") or [])})
            else:
                sim.append({k: ev.get(k) for k in SIM_KEYS})
    if not tau:
        raise CurveError(f"{run_dir}: no eval.tau events (run dflash-consume with --eval-every N --eval-prompts FILE)")
    return {"tau": sorted(tau, key=lambda p: (p["samples"], p["step"])),
            "simulated": sorted(sim, key=lambda p: (p["samples"], p["step"]))}


def plot(curves: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (label, c) in enumerate(curves.items()):
        color = f"C{i}"
        ax.plot([p["samples"] for p in c["tau"]], [p["tau"] for p in c["tau"]], "o-", color=color,
                label=f"{label}: held-out prompts (real)")
        if c["simulated"]:
            ax.plot([p["samples"] for p in c["simulated"]], [p["tau"] for p in c["simulated"]], "--", color=color,
                    alpha=0.5, label=f"{label}: next batch (simulated)")
    ax.set_xlabel("samples trained")
    ax.set_ylabel("tau (tokens per draft/verify cycle)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def parse_run(spec: str) -> tuple[str, Path]:
    """LABEL=DIR or DIR (labelled by the run folder's name; `latest` resolved)."""
    label, sep, path = spec.partition("=")
    d = Path(path if sep else spec).resolve()
    return (label if sep else d.name), d


@click.command()
@click.option("--run", "runs", required=True, multiple=True, help="A run folder, or LABEL=FOLDER; repeatable.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="PNG to write.")
@click.option("--json", "json_out", default=None, type=click.Path(dir_okay=False),
              help="The points as JSON [default: OUT with .json].")
def main(runs, out, json_out) -> None:
    curves = {}
    for spec in runs:
        label, d = parse_run(spec)
        if label in curves:
            raise click.BadParameter(f"two runs labelled {label!r}: name them LABEL=FOLDER", param_hint="--run")
        try:
            curves[label] = {"run": str(d), **run_points(d)}
        except CurveError as e:
            raise click.ClickException(str(e)) from None
    png = Path(out)
    plot(curves, png)
    js = Path(json_out) if json_out else png.with_suffix(".json")
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps(curves, indent=1))
    for label, c in curves.items():
        last = c["tau"][-1]
        print(f"{label}: {len(c['tau'])} points, tau {c['tau'][0]['tau']} at {c['tau'][0]['samples']} samples -> "
              f"{last['tau']} at {last['samples']}", file=sys.stderr)
    click.echo(json.dumps({"png": str(png), "json": str(js), "points": {k: len(c["tau"]) for k, c in curves.items()}}))


if __name__ == "__main__":
    main()
