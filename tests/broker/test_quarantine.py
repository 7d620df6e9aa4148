"""Poison batches against BrokerCore in-process (broker/fit.py, intake.py, quarantine.py):
a batch that does not fit the run's target is refused at intake and its producer's own
copy still taken; a batch consumers keep failing on is quarantined, its samples made again
once and then set aside, counted by fault, and the run still ends. Real batches (header and tensor frames through the codec, as the
server decodes them), a real SQLite ledger; the rig of tests/harness/core_rig.py."""

from __future__ import annotations

import sqlite3
from array import array

import pytest

from dflash.broker.inbound import Arrival
from dflash.broker.phase import Phase
from dflash.protocol import codec
from tests.harness.core_rig import RUN, Rig, codes, ledger_states, sent
from tests.harness.fakes import batch_frames

pytestmark = pytest.mark.unit

FACTS = {"layer_ids": [1, 2], "hidden_size": 4, "vocab_size": 100}  # fakes.batch_frames: width 8, IDs = samples


def real_batch(producer: str, lease: int, samples: list[int], *, width: int = 8, ids_plus: int = 0,
               batch_id: str | None = None) -> tuple[Arrival, list]:
    """A batch as the server hands it to the core (frames through the codec, then read), and its frames."""
    frames = batch_frames(RUN, producer, batch_id or f"{producer}-{lease}-{samples[0]}", lease, 0, samples,
                          width=width)
    if ids_plus:  # token IDs moved past the vocabulary
        frames[1] = array("i", [x + ids_plus for x in array("i", frames[1])]).tobytes()
    header = codec.unpack_header(frames[0])
    return Arrival.read(codec.decode_batch(frames, run=RUN, views=False, parsed=header), header, frames), frames


def bad_rows(core) -> list[tuple]:
    core.ledger.sync()
    db = sqlite3.connect(core.ledger.path)
    try:
        return db.execute("SELECT batch_id, action, fault, n_samples, remade, set_aside FROM bad_batches").fetchall()
    finally:
        db.close()


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


# ---------------------------------------------------------------- refused at intake


@pytest.mark.parametrize("fault,lie", [("hidden_width", {"width": 12}), ("token_ids", {"ids_plus": 100}),
                                        ("token_ids", {"ids_plus": -1000})], ids=["width", "ids_past", "ids_negative"])
def test_a_batch_that_does_not_fit_the_target_is_refused_and_the_producers_own_copy_taken(rig, fault, lie):
    rig.hello(b"prod", "producer", **FACTS)
    g = sent(rig.control(b"prod", "lease", want=4), "grant")[0].fields
    p = rig.peer(b"prod").id
    lying = real_batch(p, g["lease"], g["samples"], batch_id="liar-1", **lie)
    out = rig.arrive(*lying)
    # Not from p1's connection (no ZMTP metadata names it): dropped, p1 neither told nor ended
    assert not sent(out, "reject") and rig.core.sessions.table.by_id.get(p) is not None
    assert len(rig.core.delivery.queue) == 0 and rig.core.work.pool.open[g["lease"]].outstanding == set(g["samples"])
    assert rig.status()["bad_batches"] == {"rejected": {fault: {"batches": 1, "samples": 4}}}
    assert bad_rows(rig.core) == [("liar-1", "rejected", fault, 4, 0, 0)]
    # The producer's correct copy of the same samples is accepted, not dropped as stale
    rig.arrive(*real_batch(p, g["lease"], g["samples"]))
    assert len(rig.core.delivery.queue) == 1 and rig.peer(b"prod").stale == 0
    assert g["lease"] not in rig.core.work.pool.open


def test_facts_nobody_stated_are_not_checked_and_a_stated_vocabulary_must_agree(rig):
    rig.hello(b"prod", "producer", layer_ids=[1, 2])  # no hidden_size, no vocab_size: nothing to check with
    g = sent(rig.control(b"prod", "lease", want=4), "grant")[0].fields
    rig.arrive(*real_batch(rig.peer(b"prod").id, g["lease"], g["samples"], width=12, ids_plus=1000))
    assert len(rig.core.delivery.queue) == 1 and rig.status()["bad_batches"] == {}
    assert sent(rig.hello(b"prod2", "producer", layer_ids=[1, 2], vocab_size=100), "welcome")
    assert rig.core.facts.facts.vocab_size == 100  # a later producer fills a fact the first left out
    assert codes(rig.hello(b"prod3", "producer", layer_ids=[1, 2], vocab_size=99)) == ["config_mismatch"]
    assert codes(rig.hello(b"prod4", "producer", layer_ids=[1, 2], hidden_size="64")) == ["config_mismatch"]


# ---------------------------------------------------------------- failed on by consumers


def fail_on(rig, identity: bytes, batch_id: str, fault: str = "token_ids") -> list:
    """A consumer says it cannot train `batch_id` and leaves, as dflash-consume does."""
    out = rig.control(identity, "failed", code="bad_batch", reason=f"batch {batch_id}: {fault} wrong",
                      batch_id=batch_id, fault=fault)
    return out + rig.control(identity, "bye", reason="failed")


def test_a_batch_every_consumer_fails_on_is_quarantined_made_again_once_then_set_aside(rig):
    p, g = rig.produce()
    bid = f"{p}-1-{g['samples'][0]}"
    rig.consumer(b"c1")
    rig.dispatch()
    assert not sent(fail_on(rig, b"c1", bid), "reject")
    assert rig.core.delivery.queue.peek().batch_id == bid and rig.core.delivery.queue.peek().failures == ["c1"]  # requeued first
    rig.consumer(b"c2")
    assert [r.batch_id for r in rig.dispatch()] == [bid]
    fail_on(rig, b"c2", bid)  # the second consumer fails too (--quarantine-after 2): quarantined
    assert len(rig.core.delivery.queue) == 0 and bid not in rig.core.delivery.batch_ids and rig.core.delivery.queue.in_flight_bytes == 0
    assert rig.core.work.pool.pending() == 8  # its 4 samples went back to the pool, to be made again
    assert rig.status()["bad_batches"]["quarantined"] == {
        "token_ids": {"batches": 1, "samples": 4, "remade": 4, "set_aside": 0}}
    assert ledger_states(rig.core) == {"pending": 4}

    # Made again: the same samples come first in the next lease; every consumer fails on it again
    p, again = rig.produce()
    assert again["samples"] == g["samples"]
    bid2 = f"{p}-{again['lease']}-{again['samples'][0]}"
    for c in (b"c3", b"c4"):
        rig.consumer(c)
        rig.dispatch()
        fail_on(rig, c, bid2)
    assert rig.status()["bad_batches"]["quarantined"]["token_ids"] == {
        "batches": 2, "samples": 8, "remade": 4, "set_aside": 4}
    s = rig.status()["samples"]
    assert s["quarantined"] == 4 and s["delivered"] == 0 and rig.core.work.pool.pending() == 4

    # The rest of the run is trained, and the run ends (set-aside samples count as done)
    rig.produce()
    rig.consumer(b"c5")
    rig.dispatch()
    rig.control(b"c5", "ack", batch_ids=list(rig.peer(b"c5").in_flight), step=1)
    rig.control(b"c5", "commit", step=1, checkpoint="ckpt/1")
    beat = rig.tick(rig.advance(5))  # due: heartbeats, then end of stream
    assert rig.core.life.phase is Phase.ENDING
    stats = next(a.fields["stats"] for a in sent(beat, "heartbeat"))
    assert stats["samples_skipped"] == 4 and stats["samples_done"] == 8  # out of a consumer's schedule
    assert ledger_states(rig.core) == {"committed": 4, "quarantined": 4}
    assert [r[1:] for r in bad_rows(rig.core)] == [("quarantined", "token_ids", 4, 4, 0),
                                                   ("quarantined", "token_ids", 4, 0, 4)]
    db = sqlite3.connect(rig.core.ledger.path)
    reasons = {r for (r,) in db.execute("SELECT reason FROM samples WHERE state='quarantined'")}
    db.close()
    assert reasons == {f"token_ids: batch {bid2}: token_ids wrong"}
    for who in (b"prod", b"c5"):
        rig.control(who, "bye", reason="done")
    rig.tick(rig.advance(1))
    assert rig.core.life.phase is Phase.DONE and rig.core.outcome == "completed"


def test_a_batch_one_consumer_fails_on_and_the_next_trains_is_trained_once(rig):
    p, g = rig.produce()
    bid = f"{p}-1-{g['samples'][0]}"
    rig.consumer(b"c1")
    rig.dispatch()
    fail_on(rig, b"c1", bid, fault="hidden_width")
    rig.consumer(b"c2")
    rig.dispatch()
    rig.control(b"c2", "ack", batch_ids=[bid], step=1)
    assert rig.core.ledger.counts["trained"] == 4 and rig.status()["bad_batches"] == {}
    gone = rig.status()["gone"][-1]
    assert gone["peer"] == "c1" and gone["failure"]["batch_id"] == bid and gone["failure"]["code"] == "bad_batch"


def test_a_failure_naming_a_batch_the_consumer_does_not_hold_counts_against_nothing(rig):
    p, g = rig.produce()
    rig.consumer(b"c1")
    rig.dispatch()
    fail_on(rig, b"c1", "p1-99-0")
    assert rig.core.delivery.queue.peek().failures == [] and rig.status()["bad_batches"] == {}
