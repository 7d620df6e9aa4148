"""Lineages (PROTOCOL.md 4.5, issue 19 finding 2): the broker commits only samples whose
training the committing checkpoint's lineage holds, and a consumer that restarts from a
checkpoint sends what was trained after it back to the lease pool, to be made and trained
again exactly once. Raw clients from tests/harness/fakes.py (written from the spec alone)."""

from __future__ import annotations

import sqlite3
import time

import msgpack
import pytest
from tests.harness.fakes import FakeConsumer, FakeProducer, Rejected, batch_frames

pytestmark = pytest.mark.integration


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


def _take(c: FakeConsumer, n: int, others, timeout_s: float = 10.0) -> list[dict]:
    """`n` batch headers from `c`'s pipe, keeping every peer beating meanwhile."""
    got, end = [], time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < end:
        for p in others:
            p.pump()
        if c.data.poll(20):
            got.append(msgpack.unpackb(c.data.recv_multipart()[0]))
    assert len(got) == n, f"{c.instance} got {[h['batch_id'] for h in got]}"
    return got


def _produce(b, prod: FakeProducer, want: int) -> list[int]:
    """One lease of up to `want` samples, pushed as one-sample batches; its samples."""
    prod.send("lease", want=want)
    g = prod.wait_for({"grant"}, 5)
    for s in g["samples"]:
        prod.data.send_multipart(batch_frames(b.run_id, prod.peer, f"{prod.peer}-{g['lease']}-{s}", g["lease"],
                                              g["epoch"], [s]))
    prod.send("done", lease=g["lease"], skipped=[])
    return g["samples"]


def _committed(run_dir) -> list[int]:
    db = sqlite3.connect(f"file:{run_dir / 'ledger.sqlite'}?mode=ro", uri=True)
    try:
        return sorted(s for (s,) in db.execute("SELECT sample FROM samples WHERE state='committed'"))
    finally:
        db.close()


def test_a_restart_from_a_checkpoint_commits_only_what_its_weights_hold(start_broker):
    b = start_broker("--lease-size", "8")
    prod = FakeProducer(b.control, "p", n_samples=6, per_batch=1)
    old, new = FakeConsumer(b.control, "old"), FakeConsumer(b.control, "new")
    peers = [prod, old, new]
    first = _produce(b, prod, 6)
    assert len(first) == 6

    # lineage A trains steps 1-3 and commits step 2: steps 1 and 2 are in checkpoint A-2
    old.send("lineage", lineage="A", parent=None, step=0, checkpoint=None)
    old.send("credit", credit=3)
    mine = _take(old, 3, peers)
    for step, h in enumerate(mine, 1):
        old.send("ack", batch_ids=[h["batch_id"]], step=step, lineage="A")
    old.send("commit", step=2, checkpoint="ckpt/A-2", lineage="A")
    _pump_until(peers, lambda: b.events("broker.commit"), 5, "the commit of step 2")
    assert _committed(b.run_dir) == sorted(h["samples"][0] for h in mine[:2])
    step3 = mine[2]["samples"][0]

    # another consumer restarts the training from checkpoint A-2 (lineage B): step 3 of A
    # is in no weights that go on, so it goes back to the pool, not to `committed`
    new.send("lineage", lineage="B", parent="A", step=2, checkpoint="ckpt/A-2")
    ev = b.wait_event("broker.samples_rewound")
    assert ev["samples"] == 1 and ev["batch_ids"] == [mine[2]["batch_id"]] and ev["lineages"] == ["A"]
    again = _produce(b, prod, 8)
    assert again == [step3], again  # made again: the lease pool has it back

    # the old lineage's weights are no longer the run's: its next ack is refused
    old.send("credit", credit=1)
    stray = _take(old, 1, peers)[0]
    old.send("ack", batch_ids=[stray["batch_id"]], step=4, lineage="A")
    with pytest.raises(Rejected, match="lineage_superseded"):
        _pump_until([old], lambda: False, 5, "the rejection of a superseded lineage's ack")
    b.wait_event("broker.peer_lost", pred=lambda e: e["peer"] == old.peer)

    # B trains everything left (the stray batch came back to the queue), commits once
    new.send("credit", credit=8)
    rest = _take(new, 4, [prod, new])
    assert sorted(h["samples"][0] for h in rest) == sorted(set(first) - {h["samples"][0] for h in mine[:2]})
    for step, h in enumerate(rest, 3):
        new.send("ack", batch_ids=[h["batch_id"]], step=step, lineage="B")
    new.send("commit", step=6, checkpoint="ckpt/B-6", lineage="B")
    _pump_until([prod, new], lambda: new.stopped, 10, "end of stream")
    assert _committed(b.run_dir) == sorted(first)


def test_an_independent_consumers_commit_does_not_take_anothers_samples(start_broker):
    """Finding 2 as filed: c1 acked and vanished; c2's commit must not move c1's samples."""
    b = start_broker("--lease-size", "8")
    prod = FakeProducer(b.control, "p", n_samples=4, per_batch=1)
    c1, c2 = FakeConsumer(b.control, "c1"), FakeConsumer(b.control, "c2")
    peers = [prod, c1, c2]
    _produce(b, prod, 4)
    c1.send("lineage", lineage="one", parent=None, step=0, checkpoint=None)
    c1.send("credit", credit=2)
    for step, h in enumerate(_take(c1, 2, peers), 1):
        c1.send("ack", batch_ids=[h["batch_id"]], step=step, lineage="one")
    _pump_until(peers, lambda: (b.ask() or {}).get("samples", {}).get("trained") == 2, 5, "2 trained")
    c2.send("lineage", lineage="two", parent=None, step=0, checkpoint=None)
    c2.send("credit", credit=2)
    theirs = _take(c2, 2, peers)
    for step, h in enumerate(theirs, 1):
        c2.send("ack", batch_ids=[h["batch_id"]], step=step, lineage="two")
    c2.send("commit", step=2, checkpoint="ckpt/two-2", lineage="two")
    ev = b.wait_event("broker.commit")
    assert ev["samples"] == 2, ev  # its own two, not c1's
    assert _committed(b.run_dir) == sorted(h["samples"][0] for h in theirs)
