"""What training did, against BrokerCore in-process (broker/commits.py, lineage.py; converted
from real-broker tests whose behaviour needs no socket): a rank's ack that comes after rank
0's commit of its step is committed at once, a later step's waits for its commit; after a
clean stop a new consumer starts from the newest commit, after the job died with work not
committed new consumers are refused; a lineage must start from the newest commit, says so
once, and weights left behind are refused with their batches requeued. The typed entry
points of tests/harness/core_rig.py, an injected clock, no sockets."""

from __future__ import annotations

import sqlite3

import pytest

from dflash.broker.phase import Phase
from tests.harness.core_rig import RUN, Rig, codes, sent

pytestmark = pytest.mark.unit


def batch_states(core) -> dict[str, str]:
    core.ledger.sync()
    db = sqlite3.connect(core.ledger.path)
    try:
        return dict(db.execute("SELECT batch_id, state FROM batches"))
    finally:
        db.close()


def one_batch_each(rig: Rig, producer: bytes, consumers: list[bytes]) -> list[str]:
    """Lease len(consumers) samples, one batch of one sample each, one batch per consumer."""
    g = sent(rig.control(producer, "lease", want=len(consumers)), "grant")[0].fields
    p = rig.peer(producer).id
    for s in g["samples"]:
        rig.batch(p, g["lease"], g["epoch"], [s], batch_id=f"{p}-{s}")
    for c in consumers:
        rig.control(c, "credit", credit=1)
    rig.dispatch()
    return [rig.in_flight(c)[-1] for c in consumers]


def one_batch_trained_on_a(rig: Rig) -> str:
    """A producer `prod` and a consumer `c` on lineage A that trained (acked, not committed)
    one batch at step 1: its ID."""
    rig.hello(b"prod", "producer")
    rig.hello(b"c", "consumer")
    rig.control(b"c", "lineage", lineage="A", step=0)
    (bid,) = one_batch_each(rig, b"prod", [b"c"])
    rig.control(b"c", "ack", batch_ids=[bid], step=1, lineage="A")
    return bid


def test_an_ack_after_the_commit_of_its_step_is_committed_at_once_a_later_one_waits(tmp_path):
    with Rig(tmp_path, lease_size=4) as r:
        r.hello(b"prod", "producer")
        r.hello(b"r0", "consumer")
        r.hello(b"r1", "consumer")
        a0, c0 = one_batch_each(r, b"prod", [b"r0", b"r1"])
        r.control(b"r0", "ack", batch_ids=[a0], step=1)
        r.control(b"r0", "commit", step=1, checkpoint="ckpt/step-1")
        r.control(b"r1", "ack", batch_ids=[c0], step=1)  # rank 1's ack of step 1, after the commit
        states = batch_states(r.core)  # committed on disk now, not at the next flush or commit
        assert states[a0] == states[c0] == "committed" and not r.core.commits.trained
        a1, c1 = one_batch_each(r, b"prod", [b"r0", b"r1"])
        r.control(b"r1", "ack", batch_ids=[c1], step=2)  # not covered by the commit of step 1
        r.control(b"r0", "ack", batch_ids=[a1], step=2)
        assert r.status()["samples"]["trained"] == 2 and r.status()["samples"]["committed"] == 2
        r.control(b"r0", "commit", step=2, checkpoint="ckpt/step-2")
        assert set(batch_states(r.core).values()) == {"committed"}
        assert r.core.ledger.last_commit == (2, "ckpt/step-2")


def test_after_a_clean_stop_a_new_consumer_starts_from_the_runs_newest_commit(tmp_path):
    with Rig(tmp_path, lease_size=2) as r:
        r.hello(b"prod", "producer")
        w = sent(r.hello(b"c", "consumer"), "welcome")[0].fields
        assert "resumed_from" not in w["run_config"]  # nothing committed yet: start fresh
        (bid,) = one_batch_each(r, b"prod", [b"c"])
        r.control(b"c", "ack", batch_ids=[bid], step=1)
        r.control(b"c", "commit", step=1, checkpoint="/ckpt/step-1")
        r.control(b"c", "bye", reason="stop")
        w = sent(r.hello(b"again", "consumer"), "welcome")[0].fields
        assert w["run_config"]["resumed_from"] == {"run": RUN, "step": 1, "checkpoint": "/ckpt/step-1"}
        assert r.core.life.job_lost is None


def test_after_the_job_died_with_work_not_committed_new_consumers_are_refused(tmp_path):
    with Rig(tmp_path, lease_size=2, consumers=2, elastic=False) as r:
        r.hello(b"prod", "producer")
        r.hello(b"r0", "consumer", dist_addr="127.0.0.1:29500")
        r.hello(b"r1", "consumer")
        a, c = one_batch_each(r, b"prod", [b"r0", b"r1"])
        r.control(b"r0", "ack", batch_ids=[a], step=1)
        r.control(b"r1", "ack", batch_ids=[c], step=1)
        r.control(b"r0", "commit", step=1, checkpoint="/ckpt/step-1")
        a2, _ = one_batch_each(r, b"prod", [b"r0", b"r1"])
        r.control(b"r0", "ack", batch_ids=[a2], step=2)  # step 2 trained on both ranks, acked by one...
        r.control(b"r1", "bye", reason="failed")  # ...then the job died before any checkpoint of it
        r.control(b"r0", "bye", reason="failed")
        lost = r.core.life.job_lost
        assert r.core.life.phase is Phase.JOB_LOST and (lost.trained, lost.peer) == (1, "c1")
        out = r.hello(b"late", "consumer")
        assert codes(out) == ["job_lost"]
        reason = sent(out, "reject")[0].fields["reason"]
        assert "1 trained samples not committed" in reason and f"--resume {RUN}" in reason
        assert sent(r.hello(b"p2", "producer"), "welcome")  # producers are not refused: the run is not over
        st = r.status()
        assert st["broker"]["state"] == "job_lost" and st["job_lost"]["text"] == reason


def test_a_lineage_that_misses_the_newest_commit_is_refused_and_its_session_ends(tmp_path):
    with Rig(tmp_path, lease_size=2) as r:
        one_batch_trained_on_a(r)
        r.control(b"c", "commit", step=1, checkpoint="ckpt/A1", lineage="A")
        r.hello(b"fresh", "consumer")
        out = r.control(b"fresh", "lineage", lineage="B", step=0, checkpoint=None)  # from nothing
        assert codes(out) == ["stale_checkpoint"] and "c2" not in r.core.sessions.table.by_id
        assert "committed step 1 (ckpt/A1)" in sent(out, "reject")[0].fields["reason"]
        r.hello(b"good", "consumer")
        assert codes(r.control(b"good", "lineage", lineage="C", parent="A", step=1, checkpoint="ckpt/A1")) == []
        assert r.core.commits.lineages.head == "C"


def test_a_lineage_announced_again_changes_nothing(tmp_path):
    with Rig(tmp_path, lease_size=2) as r:
        bid = one_batch_trained_on_a(r)
        pending = r.core.work.pool.pending()
        r.control(b"c", "lineage", lineage="A", step=0)  # a retry: not a restart from nothing
        assert list(r.core.commits.trained) == [bid] and r.core.work.pool.pending() == pending


def test_an_ack_from_weights_left_behind_is_refused_and_what_that_consumer_held_requeued(tmp_path):
    with Rig(tmp_path, lease_size=4) as r:
        r.hello(b"prod", "producer")
        r.hello(b"old", "consumer")
        r.control(b"old", "lineage", lineage="A", step=0)
        b1, = one_batch_each(r, b"prod", [b"old"])
        b2, = one_batch_each(r, b"prod", [b"old"])
        r.control(b"old", "ack", batch_ids=[b1], step=1, lineage="A")
        r.hello(b"new", "consumer")
        r.control(b"new", "lineage", lineage="B", parent="A", step=1)  # A's steps past 1 are left behind
        out = r.control(b"old", "ack", batch_ids=[b2], step=2, lineage="A")
        assert codes(out) == ["lineage_superseded"] and sent(out, "reject")[0].fields.get("answers") is None
        assert "c1" not in r.core.sessions.table.by_id and r.core.delivery.queue.peek().batch_id == b2
        assert r.status()["gone"][-1]["reason"] == "ack from a superseded lineage"
        assert list(r.core.commits.trained) == [b1]  # B's weights hold step 1 of A
