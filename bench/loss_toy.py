"""--loss ce against --loss dpace on the synthetic stride stream, on CPU, in seconds.

    python bench/loss_toy.py --steps 300 --every 50 --seeds 0,1,2 --alphas 0.5,1.0

A tiny random Qwen3 target (tools/tiny.py), the learnable stream of consumers/process/synthetic.py
(each sequence has a hidden stride, carried only by the target features), and for each
seed and loss a fresh drafter trained by consumers/training/train.py on the same batches; every
`--every` steps simulated acceptance (consumers/evaluation/live_eval.py) on held-out batches of the
same stream. A toy: every block position is as learnable as the others, nothing like a
real target's text. It shows the two losses train the same drafter, and how fast; which
one gives the better drafter of a real target is for bench/recipe_sweep.py on a GPU.
Prints one JSON line per (loss, seed) and a summary line.
"""

from __future__ import annotations

import json
import statistics
import time

import click
import torch


@click.command()
@click.option("--steps", default=300, show_default=True, help="Steps per run (the lr schedule's length).")
@click.option("--every", default=50, show_default=True, help="Evaluate every N steps.")
@click.option("--seeds", default="0,1,2", show_default=True)
@click.option("--block-size", default=8, show_default=True)
@click.option("--draft-layers", default=1, show_default=True)
@click.option("--lr", default=3e-3, show_default=True)
@click.option("--modulus", default=16, show_default=True, help="Tokens of the stream (harder when larger).")
@click.option("--max-stride", default=3, show_default=True)
@click.option("--alphas", default="0.5", show_default=True, help="--dpace-alpha values to run beside ce.")
@click.option("--threads", default=1, show_default=True)
def main(steps, every, seeds, block_size, draft_layers, lr, modulus, max_stride, alphas, threads) -> None:
    from structlog.testing import capture_logs

    from dflash.consumers.evaluation.live_eval import simulated_acceptance
    from dflash.consumers.process.synthetic import rule_batch
    from dflash.consumers.training.train import train
    from dflash.consumers.training.train_config import Hooks, resolve_signal
    from dflash.consumers.training.config import TrainConfig
    from dflash.runtime.target_heads import load_target_heads
    from dflash.tools.tiny import tiny_target

    torch.set_num_threads(threads)
    heads = load_target_heads(tiny_target(family="qwen3", layers=4), dtype=torch.float32)
    layers = [1, 2]
    mask_id = heads.spec.vocab_size - 1  # outside the stream's tokens 100..100+modulus-1

    def batch(seed: int, i: int, n: int = 4):
        return rule_batch(heads.spec, layers, seed=seed * 100_003 + i, n_seqs=n, seq_len=48, modulus=modulus,
                          max_stride=max_stride, batch_id=f"s{seed}-{i}", sample_start=n * i)

    summary: dict[str, list[list[float]]] = {}
    for seed in [int(s) for s in seeds.split(",")]:
        train_batches = [batch(seed, i) for i in range(steps)]
        held_out = [batch(seed + 1_000, 10_000 + i, 8) for i in range(4)]
        for loss, alpha in [("ce", None)] + [("dpace", float(a)) for a in alphas.split(",")]:
            cfg = TrainConfig(draft_layers=draft_layers, target_layers=tuple(layers), block_size=block_size,
                              anchors=64, mask_token_id=mask_id, lr=lr, total_steps=steps, seed=seed, loss=loss,
                              dpace_alpha=alpha, log_position_every=0, save_every=0)
            signal = resolve_signal(cfg, heads)
            curve: list[tuple[int, float]] = []
            last: dict = {}

            def after(step, model, signal=signal, curve=curve, last=last):
                if step % every == 0:
                    last.update(simulated_acceptance(model, heads, held_out, signal))
                    curve.append((step, last["tau"]))

            torch.manual_seed(seed)
            t0 = time.monotonic()
            with capture_logs():
                train(cfg, heads, iter(train_batches), hooks=Hooks(after_step=after))
            name = loss if alpha is None else f"dpace alpha {alpha}"
            row = {"loss": name, "seed": seed, "seconds": round(time.monotonic() - t0, 1), "tau": curve,
                   "acc_by_position": last.get("acc_by_position")}
            print(json.dumps(row), flush=True)
            summary.setdefault(name, []).append([t for _, t in curve])
    steps_axis = list(range(every, steps + 1, every))
    print(json.dumps({"steps": steps_axis, **{
        loss: [round(statistics.mean(c[i] for c in curves), 3) for i in range(len(steps_axis))]
        for loss, curves in summary.items()}}), flush=True)


if __name__ == "__main__":
    main()
