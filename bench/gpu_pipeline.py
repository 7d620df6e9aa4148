"""End to end on GPUs: producer + broker + consumer vs each of them alone.

    python bench/gpu_pipeline.py --target DIR --data long.jsonl --producer-gpu 0 --consumer-gpu 1 --seconds 150

Three measurements, all through the real commands (`dflash-produce`, `dflash-broker`,
`dflash-consume`), rates read from their JSON log lines on stdout:
1. **producer alone**: `dflash-produce --dry-run` on the same data and settings;
2. **consumer alone**: `python bench/drafter_step.py` (the training loop of
   `dflash-consume` on batches made up front) with batches of the same shape: token budget
   / max length sequences of max length tokens, which is what the long rows pack to;
3. **pipeline**: broker + producer + consumer, the producer's batches flowing through the
   broker to the consumer.
With two GPUs, 1 and 2 run at the same time (each on its own GPU); with one GPU
(`--producer-gpu` = `--consumer-gpu`), one after the other, and the pipeline shares the
GPU, so its bound is 1 / (1/P + 1/C) rather than min(P, C); both are reported.

A rate is steady state: tokens of the events after the first quarter (compilation,
allocator warm-up) over the time they took. Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from common import command_path
from dflash.protocol.sockets import free_port_block
from dflash.tools.procs import ProcessGroup


def log_events(path: Path, event: str) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a half-written last line
            if e.get("event") == event:
                out.append(e)
    return out


def steady_rate(events: list[dict], field: str = "tokens") -> dict:
    """Tokens/s over the events after the first quarter (at least 2 dropped)."""
    from datetime import datetime

    if len(events) < 5:
        return {"tokens_per_s": None, "events": len(events)}
    t = [datetime.fromisoformat(e["ts"].replace("Z", "+00:00")).timestamp() for e in events]
    k = max(2, len(events) // 4)
    span = t[-1] - t[k]
    return {"tokens_per_s": round(sum(e[field] for e in events[k + 1:]) / span) if span > 0 else None,
            "events": len(events), "timed": len(events) - k - 1, "span_s": round(span, 1)}


def _producer_args(target, data, gpu, budget, max_length, max_batch) -> list[str]:
    device = ["--device", "cpu"] if gpu < 0 else ["--gpu", str(gpu)]
    return ["--target", target, "--data", data, *device, "--token-budget", str(budget),
            "--max-length", str(max_length), "--max-batch-size", str(max_batch), "--lease-size", "64"]


def _consumer_args(target, gpu, attn, fuse) -> list[str]:
    device = [] if gpu < 0 else ["--gpu", str(gpu)]
    return ["--target", target, *device, "--block-size", "16", "--anchors", "512", "--draft-layers", "5",
            "--attn", attn, "--fuse", fuse, "--save-every", "0", "--log-position-every", "0"]


def _run_for(group: ProcessGroup, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not group.all_exited():
        time.sleep(1)
    group.stop(grace_s=5)


def _pipeline(work: Path, prod: list[str], cons: list[str], seconds: float, env: dict) -> dict:
    """Broker + producer + consumer for `seconds`; steady rates of both ends."""
    base = free_port_block(8)
    broker = f"tcp://127.0.0.1:{base}"
    group = ProcessGroup()
    group.start("broker", [command_path("dflash-broker"), "--bind", "127.0.0.1", "--port", str(base),
                           "--data-in-port", str(base + 1), "--data-out-ports", f"{base + 2}-{base + 5}",
                           "--runs-dir", str(work / "runs"), "--epochs", "100", "--consumers", "1",
                           "--queue-bytes", "8GiB", "--max-message-bytes", "1GiB", "--timeout-s", "120"],
                work / "broker.out", env)
    group.start("producer", [command_path("dflash-produce"), *prod, "--broker", broker, "--runs-dir", str(work / "runs")],
                work / "producer.out", env)
    group.start("consumer", [command_path("dflash-consume"), *cons, "--broker", broker, "--runs-dir", str(work / "runs")],
                work / "consumer.out", env)
    _run_for(group, seconds)
    result = {}
    result["pipeline_consumer"] = steady_rate(log_events(work / "consumer.out", "train.step"))
    result["pipeline_producer"] = steady_rate(log_events(work / "producer.out", "produce.batch"))
    result["exit_codes"] = {c.name: c.proc.returncode for c in group.children}
    return result


@click.command()
@click.option("--target", required=True, help="Target folder (bench/gpu_setup.py target).")
@click.option("--data", required=True, help="Chat JSONL whose rows reach --max-length (bench/gpu_setup.py data).")
@click.option("--producer-gpu", default=0, help="GPU of the producer (-1: CPU, for a smoke test).")
@click.option("--consumer-gpu", default=1, help="GPU of the consumer (-1: CPU, for a smoke test).")
@click.option("--seconds", default=120.0, help="Length of each measurement.")
@click.option("--token-budget", default=12288, help="Producer tokens per batch.")
@click.option("--max-length", default=3072)
@click.option("--max-batch-size", default=64)
@click.option("--attn", default="sdpa", type=click.Choice(["sdpa", "flex"]), help="Drafter attention.")
@click.option("--fuse", default="off", type=click.Choice(["auto", "on", "off"]),
              help="Drafter fused elementwise kernels (dflash-consume --fuse), alone and in the pipeline.")
@click.option("--work", default="/tmp/dflash-gpu/pipeline", help="Folder for runs and process output.")
@click.option("--parts", default="producer_alone,consumer_alone,pipeline",
              help="Which measurements (comma-separated).")
@click.option("--limit", default=None, type=int, help="Rows for the producer alone (default: until --seconds).")
def main(target, data, producer_gpu, consumer_gpu, seconds, token_budget, max_length, max_batch_size, attn, fuse,
         work, parts, limit) -> None:
    """Pipeline tokens/s against min(producer alone, consumer alone)."""
    work = Path(work) / time.strftime("%H%M%S")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    prod = _producer_args(target, data, producer_gpu, token_budget, max_length, max_batch_size)
    cons = _consumer_args(target, consumer_gpu, attn, fuse)
    seqs = token_budget // max_length
    result = {"producer_gpu": producer_gpu, "consumer_gpu": consumer_gpu, "token_budget": token_budget,
              "drafter_attn": attn, "drafter_fuse": fuse, "seconds": seconds}
    parts = set(parts.split(","))
    limit_args = ["--limit", str(limit)] if limit else []
    alone = [(name, argv) for name, argv in [
                 ("producer_alone", [command_path("dflash-produce"), *prod, "--dry-run", *limit_args,
                                     "--runs-dir", str(work / "p")]),
                 ("consumer_alone", [sys.executable, str(Path(__file__).with_name("drafter_step.py")),
                                     "--gpu", str(consumer_gpu),
                                     "--seqs", str(seqs), "--seq-len", str(max_length), "--steps", "12",
                                     "--attn", attn, "--fuse", fuse, "--skip-check", "--block-size", "16",
                                     "--anchors", "512"])]
             if name in parts]
    if alone:
        together = producer_gpu != consumer_gpu
        group = ProcessGroup()
        for name, argv in alone:
            group.start(name, argv, work / f"{name}.out", env)
            if not together:
                _run_for(group, seconds)
                group = ProcessGroup()
        if together:
            _run_for(group, seconds)
    if "producer_alone" in parts:
        out = work / "producer_alone.out"
        result["producer_alone"] = steady_rate(log_events(out, "produce.batch"))
        result["producer_alone"]["done"] = next(iter(log_events(out, "produce.done")), None)
    if "consumer_alone" in parts:
        bench = [json.loads(x) for x in (work / "consumer_alone.out").read_text().splitlines()
                 if x.startswith('{"attn"')]
        result["consumer_alone"] = bench[-1] if bench else {"tokens_per_s": None}
    if "pipeline" in parts:
        result.update(_pipeline(work, prod, cons, seconds, env))
    p, c = (result.get(k, {}).get("tokens_per_s") for k in ("producer_alone", "consumer_alone"))
    got = result.get("pipeline_consumer", {}).get("tokens_per_s")
    if p and c and got:
        bound = min(p, c) if producer_gpu != consumer_gpu else 1 / (1 / p + 1 / c)
        result["bound_tokens_per_s"] = round(bound)
        result["pipeline_vs_bound"] = round(got / bound, 3)
    result["work"] = str(work)
    click.echo(json.dumps(result))


if __name__ == "__main__":
    main()
