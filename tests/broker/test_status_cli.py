"""`dflash-status` against a live broker: the human view, `--json`, a lost peer shown
with when and why, and a broker that does not answer."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.harness.fakes import FakeConsumer, FakeProducer, Pumping
from dflash.protocol.sockets import free_port_block
import pytest

pytestmark = pytest.mark.integration


def _status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.tools.status_command", *args], capture_output=True, text=True,
                          timeout=30)


def test_status_shows_run_queue_peers_and_the_lost(start_broker):
    b = start_broker()
    prod = FakeProducer(b.control, "gpu0", n_samples=100)
    cons = FakeConsumer(b.control, "gpu5")
    ghost = FakeConsumer(b.control, "gpu6")
    ghost.send("credit", credit=2)
    ghost.close()  # goes silent without bye: lost after --timeout-s 1.5
    with Pumping(prod, cons):
        b.wait_event("broker.peer_lost", 5, lambda e: e["peer_instance"] == "gpu6")
        human = _status("--broker", b.control)
        raw = _status("--broker", b.control, "--json")
    assert human.returncode == 0, human.stderr
    out = human.stdout
    assert b.run_id in out and "queue" in out and "samples" in out
    rows = {line.split()[2]: line for line in out.splitlines() if line.startswith(("producer", "consumer"))}
    assert rows["gpu0"].split()[:2] == ["producer", "p1"] and rows["gpu5"].split()[:2] == ["consumer", "c1"]
    assert "lost" in rows["gpu6"] and "silent for" in rows["gpu6"]
    st = json.loads(raw.stdout)
    assert st["run_id"] == b.run_id
    assert {"broker", "queue", "samples", "rates", "peers", "gone", "config", "facts"} <= set(st)
    assert {p["instance"] for p in st["peers"]} == {"gpu0", "gpu5"}
    live = {p["instance"]: p for p in st["peers"]}
    assert live["gpu5"]["stats"]["state"] == "training" and live["gpu5"]["heartbeat_age_s"] < 1.5
    assert st["gone"][0]["state"] == "lost" and st["gone"][0]["held"]["credit"] == 2
    assert st["samples"]["total"] == 100


def test_status_of_a_broker_that_does_not_answer_exits_1_in_one_line():
    port = free_port_block(1)
    r = _status("--broker", f"tcp://127.0.0.1:{port}", "--timeout-s", "0.3")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "no answer" in r.stderr and str(port) in r.stderr
