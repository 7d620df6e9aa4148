"""A real run with --regenerate (broker, CPU producer on a tiny target, consumer: three
processes on loopback): with the regeneration thread running ahead of the leases
(producers/regen_ahead.py) the drafter is not starved once it trains, by its own record
(`train.step` `queue`: batches in its inbox and in the broker's queue after each step);
the regenerated answers in the run's cache equal regenerating each row alone (greedy,
exact).

The long form (DFLASH_LONG=1) also runs the old way (--regen-ahead 0: a lease's rows all
regenerated when it comes, decoded a lease at a time) and shows that it starves the
drafter more: the measure can tell the two apart.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash.protocol.sockets import free_port_block
from dflash.tools.procs import ProcessGroup

pytestmark = pytest.mark.integration

# A drafter deep and wide enough to train slower than the regeneration thread makes rows on
# CPU (and the regeneration outlasting the drafter's start): then nothing should starve it.
N_ROWS, LEASE, NEW, REGEN_ROWS = 96, 4, 16, 64
LONG = os.environ.get("DFLASH_LONG") == "1"


def _run(tmp: Path, ahead: int) -> tuple[list[dict], list[dict], Path]:
    """One run to its end. Returns (broker events, producer events, the regen cache folder)."""
    from dflash.tools.tiny import tiny_target

    import dflash.producers.sample_data as sample_data

    chats = (Path(sample_data.__file__).parent / "chats.jsonl").read_text().splitlines()
    (tmp / "chats.jsonl").write_text("\n".join(chats[:N_ROWS]) + "\n")
    target, runs = str(tiny_target()), str(tmp / "runs")
    base = free_port_block(4)
    broker = f"tcp://127.0.0.1:{base}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(OMP_NUM_THREADS="1", DFLASH_LOG_JSON="1")
    py = [sys.executable, "-m"]
    group = ProcessGroup()
    group.start("broker", py + ["dflash.broker.broker_command", "--bind", "127.0.0.1", "--port", str(base), "--data-in-port",
                                str(base + 1), "--data-out-ports", f"{base + 2}-{base + 3}", "--runs-dir", runs,
                                "--epochs", "1", "--heartbeat-s", "0.5", "--timeout-s", "30", "--progress-s", "0.5",
                                "--lease-size", str(LEASE)], tmp / "broker.out", env)
    group.start("producer", py + ["dflash.producers.produce_command", "--broker", broker, "--runs-dir", runs, "--instance", "p0",
                                  "--device", "cpu", "--target", target, "--data", str(tmp / "chats.jsonl"),
                                  "--token-budget", "512", "--max-length", "512", "--max-batch-size", "4",
                                  "--lease-size", str(LEASE), "--prefetch", "2", "--regenerate", "--max-new-tokens",
                                  str(NEW), "--regen-batch-size", str(REGEN_ROWS), "--regen-ahead", str(ahead),
                                  "--regen-cache", str(tmp / "regen")], tmp / "producer.out", env)
    group.start("consumer", py + ["dflash.consumers.process.consume_command", "--broker", broker, "--runs-dir", runs, "--instance", "c0",
                                  "--target", target, "--block-size", "16", "--anchors", "64", "--draft-layers", "4",
                                  "--save-every", "0"], tmp / "consumer.out", env)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not group.all_exited() and not group.failed():
            time.sleep(0.3)
    finally:
        failed = group.failed() or [c for c in group.children if c.alive()]
        group.stop(grace_s=10)
    if failed:
        pytest.fail("; ".join(f"{c.name} rc={c.proc.returncode}: {c.out_path.read_text()[-1500:]}" for c in failed))
    (run_dir,) = [p for p in Path(runs).iterdir() if p.name != "latest"]

    def events(role: str) -> list[dict]:
        (log,) = (run_dir / "logs").glob(f"{role}-*.jsonl")
        return [json.loads(x) for x in log.read_text().splitlines()]

    return events("consumer"), events("producer"), tmp / "regen"


def starved(consumer: list[dict]) -> tuple[float, int]:
    """(share of the drafter's steps after which nothing was ready for its next step: its
    inbox and the broker's queue both empty; steps counted, the last one left out: nothing
    comes after it). The broker's `waiting_consumers` cannot tell: a drafter with a full
    inbox but credit left counts as waiting there whenever the broker's queue is empty."""
    steps = [e for e in consumer if e["event"] == "train.step"][:-1]
    empty = [e for e in steps if e["queue"]["prefetched"] == 0 and e["queue"]["q_hs"] == 0]
    return len(empty) / max(1, len(steps)), len(steps)


def _one_by_one(cache_dir: Path, samples: list[int]) -> None:
    """The run's cached rows against regenerating each alone (a decoder of one row)."""
    from transformers import AutoTokenizer

    from dflash.producers.data import open_dataset
    from dflash.producers.regenerate import RegenCache, Regenerator
    from dflash.producers.target import load_target
    from dflash.tools.tiny import tiny_target

    (path,) = cache_dir.glob("*.sqlite")
    run_cache = RegenCache(cache_dir, path.stem)
    data = open_dataset(cache_dir.parent / "chats.jsonl")
    target = load_target(str(tiny_target()), None, device=torch.device("cpu"), full=True)
    regen = Regenerator(target, AutoTokenizer.from_pretrained(tiny_target()), RegenCache(cache_dir.parent / "ref", "k"),
                        max_new_tokens=NEW, batch_size=1)
    got = run_cache.get(samples)
    assert sorted(got) == samples and len(run_cache) == N_ROWS
    for s in samples:
        (alone,) = regen.apply([data.read(s)])
        assert (got[s].input_ids, got[s].loss_mask) == (alone.input_ids, alone.loss_mask), s


@pytest.mark.slow
def test_the_drafter_is_not_starved_while_epoch_1_is_regenerated(tmp_path):
    consumer, producer, cache = _run(tmp_path, ahead=N_ROWS)
    share, ticks = starved(consumer)
    regen = [e for e in producer if e["event"] == "produce.regen"]
    ahead = [e for e in producer if e["event"] == "produce.regen_ahead"]
    print(f"\nregen ahead: nothing ready after {share:.0%} of {ticks} steps; rows ready when leased: "
          f"{sum(e['ready'] for e in regen)}/{N_ROWS}")
    assert len(ahead) == 1 and ahead[0]["ahead"] == N_ROWS
    assert sum(e["generated"] for e in regen) == N_ROWS and sum(e["rows"] for e in regen) == N_ROWS
    assert ticks >= 4 and share <= 0.25, (share, ticks)
    _one_by_one(cache, [0, 5, 17, 33, N_ROWS - 1])


@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="long form: DFLASH_LONG=1")
def test_regenerating_per_lease_starves_the_drafter_more(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ahead, _ = starved(_run(tmp_path / "a", ahead=N_ROWS)[0])
    per_lease, _ = starved(_run(tmp_path / "b", ahead=0)[0])
    print(f"\ndrafter waiting: ahead {ahead:.0%}, per lease {per_lease:.0%}")
    assert per_lease > ahead + 0.2
