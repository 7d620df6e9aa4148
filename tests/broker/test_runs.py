"""Run identity (docs/DESIGN.md incident 5): a producer holding an old run's ID is refused
and says why; two consecutive runs never share a log file; the handshake refuses
duplicates and mismatched producers; SIGTERM shuts down cleanly."""

from __future__ import annotations

import json
import os
import sqlite3
import time

import msgpack
import pytest
from tests.harness.fakes import FakeConsumer, FakeProducer, Rejected
from tests.harness.spawn import FAKES, spawn

pytestmark = pytest.mark.integration


def test_old_run_id_refused_and_runs_never_share_a_log_file(start_broker):
    a = start_broker()
    assert a.stop() == 0
    a_log = a.run_dir / "logs" / "broker-main.jsonl"
    a_bytes = a_log.read_bytes()
    info = json.loads((a.run_dir / "run.json").read_text())
    assert info["outcome"] == "interrupted" and info["signal"] == "SIGTERM"

    b = start_broker()
    assert b.run_id != a.run_id and b.run_dir != a.run_dir
    prod = spawn(FAKES, "producer", b, "--run", a.run_id, "--instance", "stale")
    out, err = prod.communicate(timeout=20)
    assert prod.returncode == 3
    assert "run_mismatch" in err and a.run_id in err and b.run_id in err  # says why, to a human
    said = [json.loads(line) for line in out.splitlines() if '"fake.rejected"' in line]
    assert said and a.run_id in said[0]["reason"]  # and in its log line
    assert "leave out --run-id" in said[0]["reason"]  # the option peers have (it said --run)
    rej = b.wait_event("broker.peer_rejected", 5, lambda e: e["code"] == "run_mismatch")
    assert rej["peer_instance"] == "stale"
    assert b.stop() == 0

    # run A's file was not touched by run B; each file holds only its own run's lines
    assert a_log.read_bytes() == a_bytes
    b_log = b.run_dir / "logs" / "broker-main.jsonl"
    for path, run in ((a_log, a.run_id), (b_log, b.run_id)):
        assert {json.loads(line)["run_id"] for line in path.read_text().splitlines()} == {run}
    assert os.readlink(b.runs_dir / "latest") == b.run_id


def test_duplicate_instance_and_mismatched_producer_refused(start_broker):
    b = start_broker()
    c1 = FakeConsumer(b.control, "gpu5")
    with pytest.raises(Rejected, match="duplicate_instance.*gpu5"):
        # Another process: the same pid and host on a new connection is a reconnect (test_control_blind_spots)
        FakeConsumer(b.control, "gpu5", pid=os.getpid() + 1)
    p1 = FakeProducer(b.control, "t0", n_samples=100)
    with pytest.raises(Rejected, match="config_mismatch.*100"):
        FakeProducer(b.control, "t1", n_samples=99)
    with pytest.raises(Rejected, match="config_mismatch.*fingerprint"):
        FakeProducer(b.control, "t2", n_samples=100, fingerprint="other")
    # peer IDs are never reused: a consumer joining after c1 left is c2
    c1.send("bye", reason="test")
    c1.close()
    # c2's hello comes on another connection: ZeroMQ does not order it after c1's bye
    b.wait_event("broker.peer_left", 10, lambda e: e["peer"] == "c1")
    c2 = FakeConsumer(b.control, "gpu5")
    assert (c1.peer, c2.peer, p1.peer) == ("c1", "c2", "p1")
    c2.close()
    p1.close()


def test_sigterm_stops_peers_persists_ledger_and_exits_0(start_broker):
    b = start_broker("--lease-size", "4")
    prod = FakeProducer(b.control, "t0", n_samples=8)
    cons = FakeConsumer(b.control, "c")
    prod.send("lease", want=4)
    grant = prod.wait_for({"grant"}, 5)
    assert b.stop() == 0
    deadline = time.monotonic() + 1.0
    while cons.stopped is None and time.monotonic() < deadline:
        cons.pump()
        time.sleep(0.02)
    assert cons.stopped == "shutdown"  # told, rather than left to time out
    info = json.loads((b.run_dir / "run.json").read_text())
    assert info["outcome"] == "interrupted" and info["ended_at"]
    # The broker drained (PROTOCOL.md 4.6): these fakes do not answer `stop`, so they were
    # declared lost meanwhile, and the producer's lease went back to the pool, on disk.
    db = sqlite3.connect(b.run_dir / "ledger.sqlite")
    rows = db.execute("SELECT sample, state FROM samples ORDER BY sample").fetchall()
    assert rows == [(s, "pending") for s in sorted(grant["samples"])]
    (stop,) = b.events("broker.stop")
    assert stop["reason"] == "signal SIGTERM" and stop["drain"] == "drained"
    assert {e["peer_instance"] for e in b.events("broker.peer_lost")} == {"t0", "c"}
    prod.close()
    cons.close()


def test_consumers_get_ranks_in_hello_order_and_rank_0s_rendezvous(start_broker):
    b = start_broker("--consumers", "2")
    c0 = FakeConsumer(b.control, "g0", config={"dist_addr": "127.0.0.1:29500"})
    c1 = FakeConsumer(b.control, "g1")
    ranks = [(c.welcome["run_config"]["rank"], c.welcome["run_config"]["world_size"],
              c.welcome["run_config"]["dist"]) for c in (c0, c1)]
    assert ranks == [(0, 2, "tcp://127.0.0.1:29500"), (1, 2, "tcp://127.0.0.1:29500")]
    with pytest.raises(Rejected, match="full.*2 ranks"):
        FakeConsumer(b.control, "g2")
    c0.send("bye", reason="test")
    # c0's bye and c3's hello come on two connections: c3 may only ask once the bye is in
    b.wait_event("broker.peer_left", 30, lambda e: e["peer_instance"] == "g0")
    c3 = FakeConsumer(b.control, "g3", config={"dist_addr": "tcp://10.0.0.9:29501"})
    assert c3.welcome["run_config"]["rank"] == 0 and c3.welcome["run_config"]["dist"] == "tcp://10.0.0.9:29501"
    assert c3.welcome["data_out"] != c0.welcome["data_out"]  # ports rotate, never handed straight back
    for c in (c0, c1, c3):
        c.close()


def test_messages_from_a_lost_peer_or_with_another_runs_id_are_refused(start_broker):
    b = start_broker()
    c = FakeConsumer(b.control, "gpu7")
    b.wait_event("broker.peer_lost", 5, lambda e: e["peer_instance"] == "gpu7")  # c did not beat
    c.send("ack", batch_ids=["p1-1"], step=3)
    with pytest.raises(Rejected, match="unknown_peer"):
        c.wait_for({"welcome"}, 3)
    other_run = FakeConsumer(b.control, "gpu8")
    other_run.ctl.send(msgpack.packb({"v": 1, "type": "credit", "run": "20200101T000000Z-dead", "credit": 1}))
    with pytest.raises(Rejected, match="run_mismatch"):
        other_run.wait_for({"grant"}, 3)
    c.close()
    other_run.close()
