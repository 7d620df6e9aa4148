"""Consumers joining a live run (PROTOCOL.md 4.1, docs/RELIABILITY.md 7): after a clean
stop (everything trained was committed) a new consumer is told to start from the run's
newest commit; after the training job died with trained-but-uncommitted samples, which
only the dead weights held and this run will not make again, new consumers are refused
(`job_lost`) so nobody trains on as if those samples were in the weights."""

from __future__ import annotations

import time

import msgpack
import pytest
from tests.harness.fakes import FakeConsumer, FakeProducer, Rejected, batch_frames

pytestmark = pytest.mark.integration


def _one_batch_each(b, prod: FakeProducer, consumers: list[FakeConsumer]) -> list[str]:
    """Lease len(consumers) samples, push them as one-sample batches, take one per consumer."""
    for c in consumers:
        c.send("credit", credit=1)
    prod.send("lease", want=len(consumers))
    g = prod.wait_for({"grant"}, 5)
    for s in g["samples"]:
        prod.data.send_multipart(batch_frames(b.run_id, prod.peer, f"{prod.peer}-{s}", g["lease"], 0, [s]))
    got, end = [], time.monotonic() + 10
    for c in consumers:
        while time.monotonic() < end:
            for p in [prod, *consumers]:
                p.pump()
            if c.data.poll(20):
                got.append(msgpack.unpackb(c.data.recv_multipart()[0])["batch_id"])
                break
    assert len(got) == len(consumers), got
    return got


def test_after_a_clean_stop_a_new_consumer_starts_from_the_runs_newest_commit(start_broker):
    b = start_broker("--lease-size", "2")
    prod = FakeProducer(b.control, "p", n_samples=4, per_batch=1)
    c = FakeConsumer(b.control, "c")
    assert "resumed_from" not in c.welcome["run_config"]  # nothing committed yet: start fresh
    (bid,) = _one_batch_each(b, prod, [c])
    c.send("ack", batch_ids=[bid], step=1)
    c.send("commit", step=1, checkpoint="/ckpt/step-1")
    c.send("bye", reason="stop")
    b.wait_event("broker.peer_left", 5)
    again = FakeConsumer(b.control, "again")
    assert again.welcome["run_config"]["resumed_from"] == {"run": b.run_id, "step": 1, "checkpoint": "/ckpt/step-1"}
    assert not b.events("broker.job_lost")
    for p in (prod, c, again):
        p.close()


def test_after_the_job_died_with_uncommitted_work_new_consumers_are_refused(start_broker):
    b = start_broker("--lease-size", "2", "--consumers", "2")
    prod = FakeProducer(b.control, "p", n_samples=4, per_batch=1)
    r0 = FakeConsumer(b.control, "r0", config={"dist_addr": "127.0.0.1:29500"})
    r1 = FakeConsumer(b.control, "r1")
    a, c = _one_batch_each(b, prod, [r0, r1])
    r0.send("ack", batch_ids=[a], step=1)
    r1.send("ack", batch_ids=[c], step=1)
    r0.send("commit", step=1, checkpoint="/ckpt/step-1")
    b.wait_event("broker.commit", 5)
    a2, _ = _one_batch_each(b, prod, [r0, r1])
    r0.send("ack", batch_ids=[a2], step=2)  # step 2 trained on both ranks, acked by one...
    r1.send("bye", reason="failed")  # ...then the job died (RankLost) before any checkpoint of it
    r0.send("bye", reason="failed")
    lost = b.wait_event("broker.job_lost", 5)
    assert lost["trained"] == 1 and lost["last_commit"] == [1, "/ckpt/step-1"]
    with pytest.raises(Rejected, match=rf"job_lost: .*1 trained samples not committed.*--resume {b.run_id}"):
        FakeConsumer(b.control, "late")
    FakeProducer(b.control, "p2", n_samples=4).close()  # producers are not refused: the run is not over
    for p in (prod, r0, r1):
        p.close()
