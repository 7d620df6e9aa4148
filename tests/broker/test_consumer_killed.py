"""A consumer SIGKILLed mid-run (docs/DESIGN.md incident 4, the OOM-killed drafter): the
broker declares it lost within the heartbeat timeout, logs what it held, and its
unacked batches are trained by the others; no sample is lost."""

from __future__ import annotations

import json
import signal
import sqlite3
import time
from datetime import datetime

from tests.harness.spawn import FAKES, spawn
import pytest

pytestmark = pytest.mark.integration

N_SAMPLES = 80
TIMEOUT_S = 1.5  # conftest starts brokers with --timeout-s 1.5 --heartbeat-s 0.2
TICK_S = 0.2  # the loop checks liveness every 100 ms; leave it two ticks


def _ts(ev: dict) -> float:
    return datetime.fromisoformat(ev["ts"].replace("Z", "+00:00")).timestamp()


def test_killed_consumer_is_lost_and_its_batches_go_to_others(start_broker):
    b = start_broker("--lease-size", "8")
    victim = spawn(FAKES, "consumer", b, "--instance", "victim", "--prefetch", "4", "--train-s", "0.5")
    time.sleep(0.3)  # the victim joins first, so it fills its credit before the others exist
    prod = spawn(FAKES, "producer", b, "--n-samples", str(N_SAMPLES), "--delay-s", "0.02")
    others = [spawn(FAKES, "consumer", b, "--instance", f"ok{i}", "--train-s", "0.01") for i in range(2)]
    try:
        deadline = time.monotonic() + 15
        held = 0
        while held < 3 and time.monotonic() < deadline:
            rows = [p for p in (b.ask() or {}).get("peers", []) if p["instance"] == "victim"]
            held = rows[0]["in_flight"] if rows else 0
            time.sleep(0.02)
        assert held >= 3, "victim never held 3 unacked batches"
        victim.send_signal(signal.SIGKILL)
        t_kill = time.time()
        lost = b.wait_event("broker.peer_lost", 10, lambda e: e["peer_instance"] == "victim")
        assert _ts(lost) - t_kill <= TIMEOUT_S + TICK_S + 0.3
        assert lost["held"]["in_flight"] >= 3
        requeued = set(lost["held"]["batch_ids"])
        for p in [prod, *others]:
            p.communicate(timeout=30)
            assert p.returncode == 0
        assert b.proc.wait(15) == 0
    finally:
        for p in [victim, prod, *others]:
            if p.poll() is None:
                p.kill()
    db = sqlite3.connect(b.run_dir / "ledger.sqlite")
    assert db.execute("SELECT COUNT(*) FROM samples WHERE state='committed'").fetchone()[0] == N_SAMPLES
    victim_id = lost["peer"]
    rows = db.execute(
        f"SELECT batch_id, consumer, deliveries FROM batches WHERE batch_id IN ({','.join('?' * len(requeued))})",
        sorted(requeued)).fetchall()
    assert len(rows) == len(requeued)
    assert all(consumer != victim_id and deliveries == 2 for _, consumer, deliveries in rows), rows
    # the survivors' own logs show they trained those batches
    acked = {json.loads(line)["batch_id"] for i in range(2)
             for line in (b.run_dir / "logs" / f"consumer-ok{i}.jsonl").read_text().splitlines()
             if json.loads(line)["event"] == "fake.acked"}
    assert requeued <= acked
