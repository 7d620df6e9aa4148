"""Late acks (PROTOCOL.md 4.5): each data-parallel rank acks on its own connection, so a
rank's ack of step N can reach the broker after rank 0's commit of step N. The checkpoint
of N holds those samples, so the broker commits them on arrival; an ack of a later step
stays `trained` until the commit that covers it."""

from __future__ import annotations

import sqlite3
import time

from tests.harness.fakes import FakeConsumer, FakeProducer, batch_frames
import pytest

pytestmark = pytest.mark.integration


def _take(c: FakeConsumer, n: int, others, timeout_s: float = 10.0) -> list[str]:
    """`n` batch IDs from `c`'s pipe, keeping every peer beating meanwhile."""
    import msgpack

    got, end = [], time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < end:
        for p in others:
            p.pump()
        if c.data.poll(20):
            got.append(msgpack.unpackb(c.data.recv_multipart()[0])["batch_id"])
    assert len(got) == n, f"{c.instance} got {got}"
    return got


def _states(run_dir) -> dict[str, str]:
    db = sqlite3.connect(f"file:{run_dir / 'ledger.sqlite'}?mode=ro", uri=True)
    try:
        return dict(db.execute("SELECT batch_id, state FROM batches"))
    finally:
        db.close()


def _pump_until(peers, pred, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for p in peers:
            p.pump()
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_ack_arriving_after_the_commit_of_its_step_is_committed_at_once(start_broker):
    b = start_broker("--lease-size", "4")
    prod = FakeProducer(b.control, "p", n_samples=4, per_batch=1)
    r0, r1 = FakeConsumer(b.control, "rank0"), FakeConsumer(b.control, "rank1")
    peers = [prod, r0, r1]
    for c in (r0, r1):
        c.send("credit", credit=2)
    prod.send("lease", want=4)
    g = prod.wait_for({"grant"}, 5)
    for s in g["samples"]:  # four one-sample batches
        prod.data.send_multipart(batch_frames(b.run_id, prod.peer, f"{prod.peer}-{s}", g["lease"], 0, [s]))
    a = _take(r0, 2, peers)
    c = _take(r1, 2, peers)

    # step 1: rank 0 acks and commits; rank 1's ack of step 1 comes after the commit
    r0.send("ack", batch_ids=[a[0]], step=1)
    r0.send("commit", step=1, checkpoint="ckpt/step-1")
    _pump_until(peers, lambda: b.events("broker.commit"), 5, "the commit of step 1")
    r1.send("ack", batch_ids=[c[0]], step=1)
    late = _pump_until(peers, lambda: b.events("broker.ack_committed"), 5, "broker.ack_committed")
    assert late[0]["batch_ids"] == [c[0]] and late[0]["step"] == 1 and late[0]["commit_step"] == 1
    assert late[0]["checkpoint"] == "ckpt/step-1" and late[0]["samples"] == 1
    # committed means on disk now, not at the next flush or commit
    states = _states(b.run_dir)
    assert states[a[0]] == states[c[0]] == "committed", states

    # step 2: acked after the commit of step 1 but not covered by it: trained, not committed
    r1.send("ack", batch_ids=[c[1]], step=2)
    r0.send("ack", batch_ids=[a[1]], step=2)
    _pump_until(peers, lambda: (b.ask() or {}).get("samples", {}).get("trained") == 2, 5, "2 trained samples")
    assert (b.ask() or {})["samples"]["committed"] == 2
    assert len(b.events("broker.ack_committed")) == 1
    r0.send("commit", step=2, checkpoint="ckpt/step-2")
    _pump_until(peers, lambda: (b.ask() or {}).get("samples", {}).get("committed") == 4, 5, "4 committed")
    assert set(_states(b.run_dir).values()) == {"committed"}
    for p in peers:
        p.close()
