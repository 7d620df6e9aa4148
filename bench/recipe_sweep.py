"""Which training recipe gives the best drafter for a real target in a fixed budget?

    python bench/recipe_sweep.py --target T.gguf --regen CACHE.sqlite --prompts DIR \
        --samples 6000 --config lr=6e-4 --config lr=2e-3,draft_layers=2 ... --out sweep.json

One process, one GPU, the pipeline's own code: the regenerated answers of an earlier run
(the producer's regeneration cache, a SQLite file) are packed as a producer packs them
(producers/packing.py), captured once by the target (Target.capture, final hidden state
included for distillation), and each config trains a fresh drafter on the same batches with
consumers/training/train.py for `--samples` samples (its lr schedule planned over exactly those).
Each drafter is then measured three ways: simulated acceptance on held-back regenerated
samples (consumers/evaluation/live_eval.py), and real speculative decoding (dflash-eval's code,
consumers/evaluation/real_tau.py) of DIR/indist.jsonl and DIR/heldout.jsonl prompts.

A config is comma-separated key=value pairs over TrainConfig fields (`loss=dpace,dpace_alpha=0.5`
against `loss=ce` compares the losses of docs/TRAINING.md on the same batches), plus `budget` and
`seqs` (the producer's --token-budget and --max-batch-size for that config's packing,
default the producer's defaults), `epochs`, and `samples` (train on only the first that
many of the --samples, whole batches: tau against distinct samples at equal passes).
Prints one table row per config and writes every figure to --out.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import fields, replace
from pathlib import Path

import click
import numpy as np
import torch
from dflash.consumers.training.config import TrainConfig

_FIELDS = {f.name for f in fields(TrainConfig)}


_PACKING = ("budget", "seqs")
_RUN = ("epochs", "samples")


def packing_of(c: dict) -> tuple[int, int]:
    from dflash.producers.producer_config import ProducerConfig

    return int(c.get("budget", ProducerConfig.token_budget)), int(c.get("seqs", ProducerConfig.max_batch_size))


def parse_config(text: str) -> dict:
    out = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in _PACKING + _RUN and key not in _FIELDS:
            raise click.BadParameter(f"{key!r} is not a TrainConfig field (nor budget, seqs, epochs, samples)",
                                     param_hint="--config")
        out[key] = json.loads(value) if value[:1] in "-0123456789[" or value in ("true", "false") else value
    return out


def _fig(x) -> str:
    """A simulated figure, or "-" where the held-back samples had no block to measure."""
    return "-" if x is None else f"{x:.3f}"


def read_cache(path: Path, limit: int) -> list:
    from dflash.producers.chat import Encoded

    db = sqlite3.connect(path)
    rows = db.execute("SELECT sample, input_ids, loss_mask FROM regen_ids ORDER BY sample LIMIT ?", (limit,)).fetchall()
    return [Encoded(s, np.frombuffer(ids, dtype=np.int32).tolist(), list(mask)) for s, ids, mask in rows]


def capture_batches(target, encoded: list, packing: tuple[int, int], tag: str) -> list:
    from dflash.protocol.batch import Batch
    from dflash.producers.packing import pack

    n = len(target.layer_ids) * target.hidden_size
    out = []
    for i, pb in enumerate(pack(encoded, *packing)):
        dev = target.device
        h = target.capture(pb.input_ids.long().to(dev), pb.position_ids().to(dev))
        out.append(Batch.packed(pb.samples, pb.seq_lens, pb.input_ids.to(dev), pb.loss_mask.to(dev),
                                h[:, :n].contiguous(), batch_id=f"{tag}-{i}", layer_ids=target.layer_ids,
                                final_hidden=h[:, n:].contiguous()))
    return out


def first_samples(batches: list, n: int) -> list:
    """The leading batches that hold at most `n` samples (at least one batch)."""
    out, held = [], 0
    for b in batches:
        if out and held + len(b.samples) > n:
            break
        out.append(b)
        held += len(b.samples)
    return out


@click.command()
@click.option("--target", required=True, help="Target folder or .gguf file.")
@click.option("--regen", "regen", required=True, type=click.Path(exists=True, dir_okay=False),
              help="The producer's regeneration cache (SQLite) of the training prompts.")
@click.option("--prompts", required=True, type=click.Path(exists=True, file_okay=False),
              help="Folder with indist.jsonl and heldout.jsonl (bench/real_prompts.py).")
@click.option("--samples", default=6000, show_default=True, help="Training samples per config.")
@click.option("--val", default=256, show_default=True, help="Regenerated samples held back for simulated tau.")
@click.option("--eval-prompts", default=10, show_default=True, help="Prompts per set for real tau.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--config", "configs", multiple=True, required=True, help="key=value,... (see the docstring).")
@click.option("--device", default="cuda", show_default=True, help="cuda, or cpu for a smoke run on a tiny target.")
@click.option("--out", required=True, type=click.Path(dir_okay=False))
def main(target, regen, prompts, samples, val, eval_prompts, max_new_tokens, configs, device, out) -> None:
    from dflash.consumers.evaluation.live_eval import simulated_acceptance
    from dflash.consumers.evaluation.real_tau import RealTauSet
    from dflash.runtime.target_heads import load_target_heads
    from dflash.consumers.training.train import train
    from dflash.consumers.training.train_config import resolve_signal
    from dflash.producers.target import load_target
    from structlog.testing import capture_logs

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    parsed = [parse_config(c) for c in configs]
    t0 = time.monotonic()
    tgt = load_target(target, None, device=dev, dtype=str(dtype).removeprefix("torch."), final=True)
    encoded = read_cache(Path(regen), samples + val)
    train_rows, val_rows = encoded[:-val], encoded[-val:]
    packings = sorted({packing_of(c) for c in parsed})
    batches = {p: capture_batches(tgt, train_rows, p, f"b{p[0]}x{p[1]}") for p in packings}
    val_batches = capture_batches(tgt, val_rows, packing_of({}), "val")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    data_s = time.monotonic() - t0
    del tgt
    heads = load_target_heads(target, device=dev, dtype=dtype)
    sets = {name: RealTauSet.load(target, str(Path(prompts) / f"{name}.jsonl"), device=dev, dtype=dtype,
                                  max_new_tokens=max_new_tokens, limit=eval_prompts) for name in ("indist", "heldout")}
    print(f"data {data_s:.1f} s: {len(train_rows)} train / {len(val_rows)} val samples, "
          f"{sum(r.loss_mask.count(1) for r in train_rows)} loss tokens; packings {packings}", flush=True)

    results = []
    for i, c in enumerate(parsed):
        packing = packing_of(c)
        kw = {k: v for k, v in c.items() if k not in _PACKING}
        epochs = int(kw.pop("epochs", 1))
        bs = first_samples(batches[packing], int(kw.pop("samples", len(train_rows))))
        cfg = TrainConfig(**{"total_samples": sum(len(b.samples) for b in bs) * epochs, "save_every": 0,
                             "log_position_every": 0, "seed": 0, **kw})

        def stream(epochs=epochs, bs=bs, distill=cfg.distill_weight > 0):
            for e in range(epochs):
                for b in bs:
                    yield replace(b, batch_id=f"{b.batch_id}-e{e}", epoch=e,
                                  tensors={k: v for k, v in b.tensors.items() if distill or k != "final_hidden"})

        sync()
        t1 = time.monotonic()
        with capture_logs() as logs:
            state = train(cfg, heads, stream(), ckpt_root=Path(out).parent / f"sweep-ckpt-{i}")
        sync()
        train_s = time.monotonic() - t1
        signal = resolve_signal(cfg, heads)
        sim = simulated_acceptance(state.model, heads, val_batches, signal)
        row = {"config": configs[i], "steps": state.step, "samples": state.samples, "train_s": round(train_s, 1),
               "tokens_per_s": round(state.tokens / train_s), "sim": sim,
               "loss_curve": [(x["step"], x.get("loss"), x.get("streak")) for x in logs
                              if x.get("event") == "train.step" and x["step"] % 25 == 0]}
        for name, s in sets.items():
            rep = s.evaluate(state.model, signal.block_size, signal.mask_token_id, list(signal.target_layers))
            row[name] = {k: rep.get(k) for k in ("tau", "speedup", "mismatches", "tie_flips", "tau_by_family")}
        results.append(row)
        print(f"{configs[i]:40s} steps {state.step:5d} train {train_s:6.1f}s {row['tokens_per_s']:7d} tok/s "
              f"val tau {_fig(sim['tau'])} acc {_fig(sim['acc'])} | in-dist tau {row['indist']['tau']} "
              f"x{row['indist']['speedup']} | held-out tau {row['heldout']['tau']} x{row['heldout']['speedup']}",
              flush=True)
        del state
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        Path(out).write_text(json.dumps({"data_s": round(data_s, 1), "results": results}, indent=1))


if __name__ == "__main__":
    main()
