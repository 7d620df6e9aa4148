"""Does a drafter trained here make a real model faster? Train one through the pipeline,
with the README's commands and defaults, on a real pretrained target, then measure it.

    python bench/real_quality.py --target T.gguf --prompts DIR --epochs 3 --work /tmp/q [--regen-cache DIR]

1. `dflash-broker --epochs E --consumers 1`, `dflash-produce --target T --data
   DIR/train.jsonl --regenerate` and `dflash-consume --target T`, all on one GPU, to the end
   of the planned epochs (no model-specific flags; `--consumer-arg`/`--producer-arg` add
   flags for the variants of a sweep, and are recorded in the result).
2. `dflash-export` of the final checkpoint, then `dflash-eval` (bf16 on GPU, batch 1) on
   DIR/indist.jsonl (training prompts) and DIR/heldout.jsonl (families the training set
   does not contain; bench/real_prompts.py builds them), tau also per held-out family.
3. One JSON object: training time, steps, samples, the eval reports (tau, speedup,
   mismatches and tie-flips) without per-prompt rows. `--regen-cache` names a folder of
   regenerated answers from an earlier run (the producer's cache), so a fresh machine
   trains instead of regenerating.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import click

from common import command_path

from dflash.protocol.sockets import free_port_block
from dflash.tools.procs import ProcessGroup


def train(work: Path, target: str, data: Path, epochs: int, regen_cache: Path, gpu: int,
          producer_args: list[str], consumer_args: list[str], timeout_s: float, env: dict) -> dict:
    base = free_port_block(8)
    broker, runs = f"tcp://127.0.0.1:{base}", str(work / "runs")
    ports = ["--port", str(base), "--data-in-port", str(base + 1), "--data-out-ports", f"{base + 2}-{base + 5}"]
    group = ProcessGroup()
    group.start("broker", [command_path("dflash-broker"), "--bind", "127.0.0.1", *ports, "--runs-dir", runs,
                           "--epochs", str(epochs), "--consumers", "1"], work / "broker.out", env)
    group.start("producer", [command_path("dflash-produce"), "--broker", broker, "--runs-dir", runs,
                             *_device(gpu), "--target", target, "--data", str(data), "--regenerate",
                             "--regen-cache", str(regen_cache), *producer_args], work / "producer.out", env)
    group.start("consumer", [command_path("dflash-consume"), "--broker", broker, "--runs-dir", runs,
                             *(_device(gpu) if gpu >= 0 else []), "--target", target, *consumer_args], work / "consumer.out", env)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s and not group.all_exited() and not group.failed():
        time.sleep(1)
    seconds = time.monotonic() - t0
    timed_out = not group.all_exited()
    group.stop(grace_s=60)
    steps = [json.loads(x) for x in (work / "consumer.out").read_text(errors="replace").splitlines()
             if x.startswith("{") and '"train.step"' in x]
    ckpts = sorted((work / "runs" / "latest" / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    last = steps[-1] if steps else {}
    return {"train_s": round(seconds, 1), "timed_out": timed_out,
            "exit_codes": {c.name: c.proc.returncode for c in group.children}, "steps": len(steps),
            "samples": last.get("samples"), "loss_last": last.get("loss"), "acc_last": last.get("acc"),
            "streak_last": last.get("streak"), "lr_last": last.get("lr"),
            "streak_mean_last_10pct": _tail_mean(steps, "streak"),
            "checkpoint": str(ckpts[-1]) if ckpts else None}


def _device(gpu: int) -> list[str]:
    return ["--device", "cpu"] if gpu < 0 else ["--gpu", str(gpu)]


def _tail_mean(steps: list[dict], key: str) -> float | None:
    vals = [s[key] for s in steps[-max(1, len(steps) // 10):] if s.get(key) is not None]
    return round(sum(vals) / len(vals), 4) if vals else None


def run_eval(work: Path, target: str, drafter: Path, prompts: Path, gpu: int, max_new_tokens: int, env: dict) -> dict:
    out = work / f"eval-{prompts.stem}.json"
    argv = [command_path("dflash-eval"), "--target", target, "--drafter", str(drafter), "--prompts", str(prompts),
            "--device", "cpu" if gpu < 0 else f"cuda:{gpu}", "--dtype", "float32" if gpu < 0 else "bfloat16",
            "--max-new-tokens", str(max_new_tokens), "--json"]
    t0 = time.monotonic()
    child = ProcessGroup().start("eval", argv, out, env)
    child.proc.wait()
    text = out.read_text(errors="replace")
    # the report is the JSON line with "tau" in it: log lines (a GGUF's conversion) may come first
    reports = [x for x in text.splitlines() if x.startswith("{") and '"tau"' in x and '"event"' not in x[:80]]
    try:
        rep = json.loads(reports[-1])
    except (IndexError, ValueError):
        return {"exit_code": child.proc.returncode, "error": text[-2000:]}
    rows = rep.pop("per_prompt", [])
    return {"exit_code": child.proc.returncode, "wall_s": round(time.monotonic() - t0, 1), **rep,
            **tau_split(rows, _families(prompts), max_new_tokens)}


def _families(prompts: Path) -> dict[str, str]:
    """Row ID -> family, from a prompts file whose rows name theirs (dflash-prompts' do)."""
    out = {}
    for line in prompts.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if "id" in row and "family" in row:
            out[str(row["id"])] = row["family"]
    return out


def _mean_tau(rows: list[dict]) -> float | None:
    return round(sum(r["tau"] for r in rows) / len(rows), 4) if rows else None


def tau_split(rows: list[dict], families: dict[str, str], max_new_tokens: int) -> dict:
    """dflash-eval's per-prompt tau by family (a row's own, else its ID's prefix <family>-<n>) and by
    whether the target alone ran to `max_new_tokens` (long answers and loops) or ended before."""
    fams: dict[str, list[dict]] = {}
    for r in rows:
        fams.setdefault(families.get(r["prompt"], r["prompt"].rsplit("-", 1)[0]), []).append(r)
    split: dict[bool, list[dict]] = {True: [], False: []}
    for r in rows:
        split[r.get("target_passes", {}).get("target_only", 0) >= max_new_tokens].append(r)
    capped, ended = split[True], split[False]
    return {"tau_by_family": {k: _mean_tau(v) for k, v in sorted(fams.items())},
            "capped": {"prompts": len(capped), "tau": _mean_tau(capped)},
            "ended": {"prompts": len(ended), "tau": _mean_tau(ended)}}


@click.command()
@click.option("--target", required=True, help="Target: a .gguf file or a Hugging Face folder.")
@click.option("--prompts", required=True, type=click.Path(exists=True, file_okay=False),
              help="Folder from bench/real_prompts.py (train.jsonl, indist.jsonl, heldout.jsonl).")
@click.option("--epochs", default=3)
@click.option("--gpu", default=0, help="GPU of all three roles; -1: CPU (a smoke test).")
@click.option("--max-new-tokens", default=256, help="Evaluation length per prompt.")
@click.option("--regen-cache", default=None, help="Regeneration cache folder (kept between runs).")
@click.option("--producer-arg", "producer_args", multiple=True, help="Extra dflash-produce flag (repeatable).")
@click.option("--consumer-arg", "consumer_args", multiple=True, help="Extra dflash-consume flag (repeatable).")
@click.option("--timeout-s", default=900.0, help="Stop training after this long.")
@click.option("--work", default="/tmp/dflash-quality")
def main(target, prompts, epochs, gpu, max_new_tokens, regen_cache, producer_args, consumer_args, timeout_s, work):
    """Train a drafter for TARGET through the pipeline, export it, measure tau and speedup."""
    work = Path(work) / time.strftime("%H%M%S")
    work.mkdir(parents=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    prompts = Path(prompts)
    p_args = [a for x in producer_args for a in shlex.split(x)]
    c_args = [a for x in consumer_args for a in shlex.split(x)]
    cache = Path(regen_cache) if regen_cache else work / "regen"
    info = train(work, target, prompts / "train.jsonl", epochs, cache, gpu, p_args, c_args, timeout_s, env)
    result = {"target": target, "epochs": epochs, "producer_args": p_args, "consumer_args": c_args,
              "train": info, "work": str(work)}
    if info["checkpoint"]:
        export = work / "export"
        subprocess.run([command_path("dflash-export"), info["checkpoint"], str(export), "--target", target],
                       stdout=sys.stderr, check=False)  # stdout is this bench's JSON
        for p in (prompts / "indist.jsonl", prompts / "heldout.jsonl"):
            result[p.stem] = run_eval(work, target, export, p, gpu, max_new_tokens, env)
    click.echo(json.dumps(result))


if __name__ == "__main__":
    main()
