"""The broker's drain on SIGTERM (PROTOCOL.md 4.6): it tells its peers to stop, keeps
serving until they have committed and left, and says so in its status; a consumer's commit
sent after `stop {shutdown}` is recorded."""

from __future__ import annotations

import signal
import sqlite3
import time

from tests.harness.fakes import FakeConsumer, FakeProducer, batch_frames
import pytest

pytestmark = pytest.mark.integration


def _pump(peers, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for p in peers:
            p.pump()
        time.sleep(0.02)


def test_sigterm_waits_for_the_consumers_last_commit_and_reports_the_drain(start_broker):
    b = start_broker("--lease-size", "2", "--drain-s", "30")
    prod = FakeProducer(b.control, "p", n_samples=4, per_batch=1)
    c = FakeConsumer(b.control, "c")
    c.send("credit", credit=1)
    prod.send("lease", want=1)
    g = prod.wait_for({"grant"}, 5)
    prod.data.send_multipart(batch_frames(b.run_id, prod.peer, "p1-x", g["lease"], 0, g["samples"]))
    end = time.monotonic() + 10
    while not c.data.poll(20) and time.monotonic() < end:
        _pump([prod, c], 0.02)
    c.data.recv_multipart()
    c.send("ack", batch_ids=["p1-x"], step=1)  # trained, not yet committed

    b.proc.send_signal(signal.SIGTERM)
    b.wait_event("broker.draining", 5)
    _pump([prod, c], 1.0)  # longer than nothing, shorter than --timeout-s: both still here
    assert c.stopped == prod.stopped == "shutdown"
    st = b.ask()
    assert st["broker"]["state"] == "stopping" and st["broker"]["stop_reason"] == "shutdown"
    assert st["diagnosis"]["text"].startswith("shutdown (a signal)")
    assert b.proc.poll() is None  # waiting for us

    prod.send("bye", reason="stop")
    c.send("commit", step=1, checkpoint="/ckpt/step-1")  # what a consumer does on shutdown
    c.send("bye", reason="stop")
    assert b.proc.wait(10) == 0
    (stop,) = b.events("broker.stop")
    assert stop["drain"] == "drained" and stop["outcome"] == "interrupted" and stop["peers_left"] == []
    db = sqlite3.connect(b.run_dir / "ledger.sqlite")
    assert db.execute("SELECT step, checkpoint FROM commits").fetchall() == [(1, "/ckpt/step-1")]
    assert db.execute("SELECT state FROM samples WHERE sample=?", g["samples"]).fetchall() == [("committed",)]
    prod.close()
    c.close()


def test_a_second_signal_ends_the_drain_at_once(start_broker):
    b = start_broker("--drain-s", "60")
    c = FakeConsumer(b.control, "c")
    b.proc.send_signal(signal.SIGTERM)
    b.wait_event("broker.draining", 5)
    _pump([c], 0.3)
    b.proc.send_signal(signal.SIGTERM)
    assert b.proc.wait(5) == 0
    (stop,) = b.events("broker.stop")
    assert stop["drain"] == "second signal" and stop["peers_left"] == [c.peer]
    c.close()
