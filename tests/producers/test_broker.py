"""The real producer against the real broker (subprocesses on loopback): a producer
killed mid-run loses nothing; its leases are produced again by another producer, and
every sample of the epoch ends up produced exactly once in the broker's ledger."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tests.harness.tiny import tiny_dir
from tests.producers.helpers import write_jsonl

from dflash.producers.sample_data import generate_chats
from dflash.protocol.sockets import free_port_block as _free_ports

pytestmark = pytest.mark.integration

N = 1000



class Proc:
    """A subprocess whose stdout JSON lines are collected by a thread."""

    def __init__(self, args: list[str]):
        env = {**os.environ, "DFLASH_LOG_JSON": "1"}
        self.p = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)
        self.events: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            if line.startswith("{"):
                self.events.append(json.loads(line))

    def wait_for(self, event: str, timeout_s: float, pred=lambda e: True) -> dict:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            for e in list(self.events):
                if e["event"] == event and pred(e):
                    return e
            if self.p.poll() is not None and event not in {e["event"] for e in self.events}:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {event} in {timeout_s}s: {self.p.stderr.read()[-2000:] if self.p.poll() else ''}")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_killed_producer_leases_are_produced_by_another(tmp_path):
    data = write_jsonl(tmp_path / "chats.jsonl", generate_chats(N))
    port = _free_ports(4)
    runs = tmp_path / "runs"
    broker = Proc(["dflash.broker.broker_command", "--bind", "127.0.0.1", "--port", str(port), "--data-in-port", str(port + 1),
                   "--data-out-ports", f"{port + 2}-{port + 3}", "--runs-dir", str(runs), "--lease-size", "50",
                   "--heartbeat-s", "0.2", "--timeout-s", "1.5"])
    produce = ["dflash.producers.produce_command", "--broker", f"tcp://127.0.0.1:{port}", "--target", str(tiny_dir("qwen3", False)),
               "--data", data, "--device", "cpu", "--runs-dir", str(runs), "--lease-size", "50", "--prefetch", "1",
               "--token-budget", "512", "--max-length", "256", "--no-check-packing"]
    try:
        a = Proc([*produce, "--instance", "a"])
        # Killed once it has finished a lease and holds others: work in flight is lost.
        broker.wait_for("broker.lease_done", 60)
        a.p.send_signal(signal.SIGKILL)
        a.p.wait(10)
        lost = broker.wait_for("broker.peer_lost", 10)
        assert lost["held"]["leases"], lost
        b = Proc([*produce, "--instance", "b"])
        assert b.p.wait(120) == 0, b.p.stderr.read()[-2000:]
        done = b.wait_for("produce.done", 5)
    finally:
        for proc in (locals().get("a"), locals().get("b"), broker):
            if proc is not None and proc.p.poll() is None:
                proc.p.send_signal(signal.SIGTERM)
                proc.p.wait(10)
    (ledger,) = Path(runs).glob("2*/ledger.sqlite")
    db = sqlite3.connect(ledger)
    rows = db.execute("SELECT sample, state, producer FROM samples WHERE epoch = 0").fetchall()
    assert sorted(s for s, _, _ in rows) == list(range(N))
    assert {state for _, state, _ in rows} == {"produced"}
    by = {p: sum(1 for _, _, q in rows if q == p) for p in {q for _, _, q in rows}}
    assert len(by) == 2 and by[lost["peer"]] > 0  # both produced some; a's lost leases went to b
    assert done["samples"] == by[next(p for p in by if p != lost["peer"])]
