"""Work leases and batches in against BrokerCore in-process (broker/work.py, intake.py,
delivery.py; converted from real-broker tests whose behaviour needs no socket): a lost
producer's samples go to another and its late batch is stale; skipped samples complete a
lease and missing ones come back after the timeout, a clock that holds while the queue is
full; every live producer of a small dataset gets a share; the queue's byte bound stops
intake; dispatch serves the consumer that waited longest. The typed entry points of
tests/harness/core_rig.py, an injected clock, no sockets."""

from __future__ import annotations

import pytest

from dflash.broker.leases import MAX_OPEN_LEASES
from tests.harness.core_rig import Rig, ledger_states, sent

pytestmark = pytest.mark.unit


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path, num_samples=12, lease_size=6)
    yield r
    r.close()


def grant(rig: Rig, identity: bytes, want: int) -> dict:
    return sent(rig.control(identity, "lease", want=want), "grant")[0].fields


def test_a_lost_producers_leases_go_to_another_and_its_late_batch_is_stale(rig):
    rig.hello(b"t1", "producer")
    g1 = grant(rig, b"t1", 6)
    rig.batch("p1", g1["lease"], 0, g1["samples"][:2])
    rig.tick(rig.advance(10.5))  # p1 beats no more: lost after --timeout-s
    gone = rig.status()["gone"][-1]
    assert gone["peer"] == "p1" and gone["state"] == "lost"
    assert gone["held"] == {"leases": [g1["lease"]], "samples_returned": 4, "batches_in": 1}
    rig.hello(b"t2", "producer")
    g2 = grant(rig, b"t2", 6)
    assert g2["samples"][:4] == g1["samples"][2:]  # the returned samples come first
    rig.batch("p1", g1["lease"], 0, g1["samples"][2:4], batch_id="p1-2")  # p1's last batch, late
    assert len(rig.core.delivery.queue) == 1 and rig.core.ledger.counts["produced"] == 2
    assert rig.core.work.pool.open[g2["lease"]].outstanding == set(g2["samples"])  # nothing of p2's counted


def test_skipped_samples_complete_a_lease_and_missing_ones_come_back_after_the_timeout(tmp_path):
    with Rig(tmp_path, lease_size=4) as r:
        r.hello(b"t1", "producer")
        g = grant(r, b"t1", 4)
        s = g["samples"]
        r.batch("p1", g["lease"], 0, s[:2])
        r.control(b"t1", "done", lease=g["lease"], skipped=[[s[2], "row too long"], [s[3], "bad json"], [99, "no"]])
        assert g["lease"] not in r.core.work.pool.open  # complete: two arrived, two skipped
        g2 = grant(r, b"t1", 4)
        r.batch("p1", g2["lease"], 0, g2["samples"][:1])
        done_at = r.advance(1)
        r.control(b"t1", "done", lease=g2["lease"], skipped=[])  # three samples never sent
        r.control(b"t1", "heartbeat", stats={}, now=done_at + 9.9)
        r.tick(done_at + 9.9)
        assert g2["lease"] in r.core.work.pool.open  # within --timeout-s of its `done`
        r.tick(done_at + 10.1)
        assert g2["lease"] not in r.core.work.pool.open and "p1" in r.core.sessions.table.by_id
        assert grant(r, b"t1", 4)["samples"] == g2["samples"][1:]
        assert ledger_states(r.core) == {"skipped": 2, "produced": 3, "leased": 3}


def test_a_leases_done_clock_holds_while_the_queue_is_full(tmp_path):
    r = Rig(tmp_path, lease_size=4, queue_bytes=150)  # one batch of the rig (110 bytes) fills it
    try:
        r.hello(b"t1", "producer")
        g = grant(r, b"t1", 4)
        r.batch("p1", g["lease"], 0, g["samples"][:2])
        r.batch("p1", g["lease"], 0, g["samples"][2:3], batch_id="second")
        assert not r.core.reading  # the broker stops reading data in: batches wait in the producer's pipe
        t = r.advance(1)
        r.control(b"t1", "done", lease=g["lease"], skipped=[])
        for dt in range(1, 30):  # the producer beats; its last batch cannot come in meanwhile
            r.control(b"t1", "heartbeat", stats={}, now=t + dt)
            r.tick(t + dt)
        assert g["lease"] in r.core.work.pool.open  # not given back: the wait was the broker's
    finally:
        r.close()


def test_two_producers_of_a_small_dataset_both_get_work(tmp_path):
    """Issue 29 item 5: with leases of --lease-size 256 the first producer to ask took all 50
    samples and the other made nothing; a lease is now a share of what is left."""
    with Rig(tmp_path, num_samples=50, lease_size=256) as r:
        r.hello(b"t0", "producer")
        r.hello(b"t1", "producer")
        gs = [grant(r, who, 256)["samples"] for who in (b"t0", b"t1", b"t0", b"t1")]
        assert [len(g) for g in gs] == [25, 13, 6, 3]  # half of what is left each time, for two live producers
        r.control(b"t1", "bye", reason="done")  # its leases go back, first in line for the one left
        assert grant(r, b"t0", 256)["samples"] == gs[1] + gs[3]
        assert len(grant(r, b"t0", 256)["samples"]) == 3  # the rest: one producer's share is all of it


def test_a_producer_with_its_fill_of_open_leases_is_told_to_ask_again(rig):
    rig.hello(b"t1", "producer")
    for _ in range(MAX_OPEN_LEASES):
        assert grant(rig, b"t1", 1)["samples"]
    g = grant(rig, b"t1", 1)
    assert (g["samples"], g["end"], g["retry_ms"]) == ([], False, 500)


def test_grants_say_end_once_every_sample_is_made_unless_consumers_are_elastic(rig):
    rig.hello(b"t1", "producer")
    for _ in range(2):
        g = grant(rig, b"t1", 6)
        rig.batch("p1", g["lease"], 0, g["samples"])
    assert grant(rig, b"t1", 6)["end"] is True
    rig.core.use_lighthouse("http://testhost:29510")  # an elastic consumer may rewind: stay
    g = grant(rig, b"t1", 6)
    assert g["end"] is False and g["retry_ms"] == 500


def test_a_done_for_another_producers_lease_is_ignored(rig):
    rig.hello(b"t1", "producer")
    rig.hello(b"t2", "producer")
    g = grant(rig, b"t1", 6)
    rig.control(b"t2", "done", lease=g["lease"], skipped=[[s, "not mine"] for s in g["samples"]])
    assert rig.core.work.pool.open[g["lease"]].outstanding == set(g["samples"])
    assert rig.core.ledger.counts["skipped"] == 0


def test_a_batch_id_already_queued_is_stale(rig):
    rig.hello(b"t1", "producer")
    g = grant(rig, b"t1", 6)
    rig.batch("p1", g["lease"], 0, g["samples"][:3], batch_id="p1-0")
    rig.batch("p1", g["lease"], 0, g["samples"][3:], batch_id="p1-0")
    assert len(rig.core.delivery.queue) == 1 and rig.peer(b"t1").stale == 1
    assert rig.core.work.pool.open[g["lease"]].outstanding == set(g["samples"][3:])


def test_dispatch_serves_the_consumer_that_waited_longest_and_skips_a_pipe_not_connected(rig):
    rig.hello(b"t1", "producer")
    for _ in range(2):
        g = grant(rig, b"t1", 6)
        for s in g["samples"][:3], g["samples"][3:]:
            rig.batch("p1", g["lease"], 0, s)
    rig.consumer(b"a", credit=2)
    rig.consumer(b"b", credit=2)
    rig.pipe(b"b").full = True  # not connected yet
    out = [(r.consumer, r.batch_id) for r in rig.dispatch()]
    assert [c for c, _ in out] == ["c1", "c1"] and rig.core.blocked  # b wants a batch its pipe refused
    rig.pipe(b"b").full = False
    assert [r.consumer for r in rig.dispatch()] == ["c2", "c2"]  # b, served least recently, goes first
    assert not rig.core.blocked and len(rig.core.delivery.queue) == 0
    row = {r["peer"]: r for r in rig.status()["peers"]}
    assert row["c1"]["delivered"] == row["c2"]["delivered"] == 2 and row["c1"]["credit"] == 0


def test_batches_take_a_consumers_data_streams_in_turn_and_skip_one_that_refuses(tmp_path):
    with Rig(tmp_path, num_samples=8, lease_size=8, streams=2) as r:  # --data-streams 2
        r.hello(b"t1", "producer")
        g = grant(r, b"t1", 8)
        for s in g["samples"][:7]:
            r.batch("p1", g["lease"], 0, [s])
        r.consumer(b"a", credit=4)
        s0, s1 = r.pipe(b"a", 0), r.pipe(b"a", 1)
        assert [x.ports for x in r.dispatch()] == [(s0.port, s1.port), (s1.port, s0.port)] * 2  # in turn
        assert len(s0.sent) == len(s1.sent) == 2
        s0.full = True  # not connected, or full: the other stream takes the batch
        r.control(b"a", "credit", credit=2)
        assert len(r.dispatch()) == 2 and (len(s0.sent), len(s1.sent)) == (2, 4)
        s1.full = True
        r.control(b"a", "credit", credit=1)
        assert r.dispatch() == [] and r.core.blocked  # no stream took it: it stays queued
        assert len(r.core.delivery.queue) == 1 and r.peer(b"a").credit == 1


def test_a_consumer_with_credit_and_nothing_queued_waits(rig):
    rig.consumer(b"a", credit=2)
    rig.dispatch()
    rig.advance(3)
    rig.dispatch()
    row = rig.status()["peers"][0]
    assert row["state"] == "waiting" and row["waiting_s"] == 3.0 and row["wait_frac"] == 1.0
