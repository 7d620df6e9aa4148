"""The broker with the project's own client (protocol/links.py: ProducerLink, ConsumerLink)
on both sides, as processes: tensors go through intact and the run ends cleanly."""

from __future__ import annotations

import json
import sqlite3
import subprocess

from tests.harness.spawn import child_env, module_argv
import pytest

pytestmark = pytest.mark.integration

N_SAMPLES = 24


def _run_pair(b, n: int, consumer_io_threads: int = 0) -> tuple[dict, dict]:
    """A link_peers.py producer of `n` samples and consumer, to the end; their result lines."""
    script = "tests.broker.link_peers"
    procs = [subprocess.Popen(module_argv(script, "producer", b.control, str(b.runs_dir), str(n)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env()),
             subprocess.Popen(module_argv(script, "consumer", b.control, str(b.runs_dir), str(consumer_io_threads)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err[-800:] for _, err in outs]
    assert b.proc.wait(15) == 0
    consumer = json.loads([line for line in outs[1][0].splitlines() if '"all_ok"' in line][-1])
    producer = json.loads([line for line in outs[0][0].splitlines() if '"producer_streams"' in line][-1])
    return consumer, producer


def test_peerlink_producer_and_consumer_run_to_end_of_stream(start_broker):
    b = start_broker("--lease-size", "8")
    result, _ = _run_pair(b, N_SAMPLES)
    assert (result["samples"], result["all_ok"]) == (list(range(N_SAMPLES)), True)
    db = sqlite3.connect(b.run_dir / "ledger.sqlite")
    assert db.execute("SELECT COUNT(*) FROM samples WHERE state='committed'").fetchone()[0] == N_SAMPLES
    logs = sorted(p.name for p in (b.run_dir / "logs").glob("*.jsonl"))
    assert logs == ["broker-main.jsonl", "consumer-link-cons.jsonl", "producer-link-prod.jsonl"]


def test_a_consumers_batches_take_its_data_streams_each_on_its_own_io_thread(start_broker):
    """A broker with five I/O threads opens two data streams per consumer and per producer
    (auto); a consumer's, one on each of its pipe threads; the consumer's link connects one
    PULL to each, on I/O threads 2 and 3 of its own. Both streams carry batches, every
    sample arrives once and intact, and the ledger commits them all. With --data-streams 1: one stream, as before."""
    n = 120
    b = start_broker("--lease-size", "8", "--io-threads", "5")
    result, producer = _run_pair(b, n, consumer_io_threads=3)
    assert (result["samples"], result["all_ok"]) == (list(range(n)), True)
    assert producer["producer_streams"] == 2  # its batches in on two connections (two I/O threads) too
    assert len(result["streams"]) == 2 and sum(result["streams"]) == n and min(result["streams"]) > 0, result
    assert result["masks"] == [0b010, 0b100]
    cons = [e for e in b.events("broker.peer_joined") if e["peer_role"] == "consumer"]
    assert len(cons) == 1 and len(cons[0]["data_streams"]) == 2 and cons[0]["data_out"] == cons[0]["data_streams"][0]
    db = sqlite3.connect(b.run_dir / "ledger.sqlite")
    assert db.execute("SELECT COUNT(*) FROM samples WHERE state='committed'").fetchone()[0] == n


def test_one_data_stream_when_asked(start_broker):
    b = start_broker("--lease-size", "8", "--io-threads", "5", "--data-streams", "1")
    result, producer = _run_pair(b, 24, consumer_io_threads=3)
    assert (result["samples"], result["streams"], result["masks"]) == (list(range(24)), [24], [0b010])
    assert producer["producer_streams"] == 1
