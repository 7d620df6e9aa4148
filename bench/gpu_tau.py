"""Acceptance length and speedup of a drafter trained online, end to end on GPUs.

    python bench/gpu_tau.py --target DIR --producer-gpu 0 --consumer-gpu 1 --epochs 20

1. Splits the bundled sample chats: the first `--train-rows` are the training set, the
   next `--eval-rows` are held-out prompts.
2. Trains through the real pipeline: `dflash-broker` + `dflash-produce --regenerate`
   (assistant turns replaced by the target's own greedy output) + `dflash-consume`, to the
   end of `--epochs` epochs.
3. Runs `dflash-eval` on the held-out prompts with the final checkpoint, once per
   `--eval-dtype`: tau, acceptance, wall-clock speedup over target-only greedy decoding,
   and the lossless check (every output equal to target-only greedy).
Prints one JSON object (the eval reports without their per-prompt rows).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import click

from dflash.producers.sample_data import CHATS_PATH
from common import command_path
from dflash.protocol.sockets import free_port_block
from dflash.tools.procs import ProcessGroup


def _split(work: Path, train_rows: int, eval_rows: int) -> tuple[Path, Path]:
    lines = Path(CHATS_PATH).read_text().splitlines()
    if train_rows + eval_rows > len(lines):
        raise click.UsageError(f"only {len(lines)} bundled chats: --train-rows + --eval-rows is too many")
    train, held_out = work / "train.jsonl", work / "eval.jsonl"
    train.write_text("\n".join(lines[:train_rows]) + "\n")
    held_out.write_text("\n".join(lines[train_rows : train_rows + eval_rows]) + "\n")
    return train, held_out


def _train(work: Path, target: str, data: Path, args: dict, env: dict) -> tuple[Path | None, dict]:
    base = free_port_block(8)
    broker, runs = f"tcp://127.0.0.1:{base}", str(work / "runs")
    group = ProcessGroup()
    group.start("broker", [command_path("dflash-broker"), "--bind", "127.0.0.1", "--port", str(base),
                           "--data-in-port", str(base + 1), "--data-out-ports", f"{base + 2}-{base + 5}",
                           "--runs-dir", runs, "--epochs", str(args["epochs"]), "--consumers", "1",
                           "--timeout-s", "120", "--lease-size", "64"], work / "broker.out", env)
    producer_device = ["--device", "cpu"] if args["producer_gpu"] < 0 else ["--gpu", str(args["producer_gpu"])]
    group.start("producer", [command_path("dflash-produce"), "--broker", broker, "--runs-dir", runs, "--target", target,
                             "--data", str(data), *producer_device, "--regenerate",
                             "--max-new-tokens", str(args["max_new_tokens"]), "--regen-cache", str(work / "regen"),
                             "--regen-batch-size", str(args["regen_batch_size"]),
                             "--token-budget", "8192", "--max-length", "1024", "--lease-size", "64"],
                work / "producer.out", env)
    consumer_device = [] if args["consumer_gpu"] < 0 else ["--gpu", str(args["consumer_gpu"])]
    group.start("consumer", [command_path("dflash-consume"), "--broker", broker, "--runs-dir", runs, "--target", target,
                             *consumer_device, "--block-size", str(args["block_size"]), "--anchors", "64",
                             "--draft-layers", str(args["draft_layers"]), "--lr", str(args["lr"]),
                             "--save-every", "0", "--log-position-every", "0"], work / "consumer.out", env)
    t0, deadline = time.monotonic(), time.monotonic() + args["train_timeout_s"]
    while time.monotonic() < deadline and not group.all_exited():
        time.sleep(1)
    train_s = time.monotonic() - t0
    group.stop(grace_s=60)
    codes = {c.name: c.proc.returncode for c in group.children}
    steps = [json.loads(x) for x in (work / "consumer.out").read_text().splitlines()
             if x.startswith("{") and '"train.step"' in x]
    ckpts = sorted((work / "runs" / "latest" / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    info = {"exit_codes": codes, "train_s": round(train_s, 1), "steps": len(steps),
            "loss_first": steps[0]["loss"] if steps else None, "loss_last": steps[-1]["loss"] if steps else None,
            "acc_last": steps[-1]["acc"] if steps else None, "streak_last": steps[-1]["streak"] if steps else None}
    return (ckpts[-1] if ckpts else None), info


def _eval(work: Path, target: str, ckpt: Path, prompts: Path, gpu: int, dtype: str, new_tokens: int, env) -> dict:
    device = "cpu" if gpu < 0 else f"cuda:{gpu}"
    out = work / f"eval-{dtype}.json"
    group = ProcessGroup()
    child = group.start("eval", [command_path("dflash-eval"), "--target", target, "--drafter", str(ckpt), "--prompts",
                                 str(prompts), "--device", device, "--dtype", dtype, "--max-new-tokens",
                                 str(new_tokens), "--json"], out, env)
    child.proc.wait()
    text = out.read_text()
    try:
        rep = json.loads(text[text.index("{"):])
    except ValueError:
        return {"exit_code": child.proc.returncode, "error": text[-2000:]}
    rep.pop("per_prompt", None)
    return {"exit_code": child.proc.returncode, **rep}


@click.command()
@click.option("--target", required=True, help="A small target folder with tokenizer (bench/gpu_setup.py target).")
@click.option("--producer-gpu", default=0, help="-1: CPU (smoke test).")
@click.option("--consumer-gpu", default=1, help="-1: CPU (smoke test).")
@click.option("--epochs", default=20)
@click.option("--train-rows", default=350)
@click.option("--eval-rows", default=30)
@click.option("--max-new-tokens", default=96, help="Regeneration and evaluation length.")
@click.option("--regen-batch-size", default=64, help="Rows generated together (dflash-produce --regen-batch-size).")
@click.option("--block-size", default=16)
@click.option("--draft-layers", default=2)
@click.option("--lr", default=3e-3)
@click.option("--eval-dtype", "eval_dtypes", multiple=True, default=["float32", "bfloat16"])
@click.option("--train-timeout-s", default=300.0)
@click.option("--work", default="/tmp/dflash-gpu/tau")
def main(target, eval_dtypes, work, eval_rows, train_rows, **args) -> None:
    """Train a drafter online on a small target, then measure tau and speedup."""
    work = Path(work) / time.strftime("%H%M%S")
    work.mkdir(parents=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    train, held_out = _split(work, train_rows, eval_rows)
    ckpt, info = _train(work, target, train, args, env)
    result = {"target": target, "train_rows": train_rows, "eval_rows": eval_rows, **args, "train": info,
              "checkpoint": str(ckpt), "work": str(work)}
    if ckpt is not None:
        for dtype in eval_dtypes:
            result[f"eval_{dtype}"] = _eval(work, target, ckpt, held_out, args["consumer_gpu"], dtype,
                                            args["max_new_tokens"], env)
    click.echo(json.dumps(result))


if __name__ == "__main__":
    main()
