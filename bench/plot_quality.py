"""The real-target quality plot: acceptance against samples trained.

    python bench/plot_quality.py --steps RUN/consumer_steps.jsonl --result RUN.json \
        [--result OTHER.json ...] --out docs/img/real_target_tau.png

Left: the training-time simulated tau (streak + 1 on each step's batch, before the step
trains it; a mean over 5 logged steps) and the first block position's accuracy, against samples
trained, epochs marked. Right: dflash-eval's tau (in-distribution and held out, bf16,
batch 1) of each result file (bench/real_quality.py's JSON) against its samples trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.option("--steps", "steps_file", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--result", "results", multiple=True, type=(str, click.Path(exists=True, dir_okay=False), int),
              help="LABEL FILE SAMPLES: a bench/real_quality.py result and the samples it trained.")
@click.option("--epoch-samples", default=8000, show_default=True, help="Samples per epoch of the run in --steps.")
@click.option("--out", required=True, type=click.Path(dir_okay=False))
def main(steps_file, results, epoch_samples, out) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in Path(steps_file).read_text().splitlines()]
    steps = [r for r in rows if r["event"] == "train.step"]
    pos = [r for r in rows if r["event"] == "train.position_acc"]
    n_epoch = epoch_samples  # samples trained by a step: its epoch fraction x the epoch's samples
    xs = [r["epoch"] * n_epoch for r in steps]
    tau = [r["streak"] + 1 for r in steps]
    smooth = [sum(tau[max(0, i - 4): i + 1]) / len(tau[max(0, i - 4): i + 1]) for i in range(len(tau))]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(xs, smooth, label="simulated tau (training batches)")
    by_step = {r["step"]: r["epoch"] * n_epoch for r in steps}
    a.plot([by_step.get(p["step"], 0) for p in pos], [1 + p["acc_by_position"][0] for p in pos],
           label="1 + accuracy at block position 1")
    for e in range(1, int(steps[-1]["epoch"]) + 1):
        a.axvline(e * n_epoch, color="0.85", lw=0.8)
    a.set_xlabel("samples trained"), a.set_ylabel("tau"), a.legend(), a.set_title("during training")
    for label, path, n in results:
        r = json.loads(Path(path).read_text())
        b.scatter([n], [r["indist"]["tau"]], marker="o", label=f"{label}: in-dist")
        b.scatter([n], [r["heldout"]["tau"]], marker="x", label=f"{label}: held out")
    b.axhline(2.5, color="0.6", ls="--", lw=0.8)
    b.axhline(3.0, color="0.6", ls=":", lw=0.8)
    b.set_xscale("log"), b.set_xlabel("samples trained"), b.set_ylabel("dflash-eval tau (bf16, batch 1)")
    b.legend(fontsize=7), b.set_title("exported drafter")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    click.echo(out)


if __name__ == "__main__":
    main()
