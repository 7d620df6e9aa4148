"""The ack deadline (issue 19, finding 3): a consumer that heartbeats but never acks held
its batches forever and blocked end of stream. Now a consumer holding delivered batches
that acks none within --ack-timeout-s is declared lost (`broker.ack_overdue`), its batches
go back to the queue, and another consumer trains them. The misbehaving client is a raw
one from tests/harness/fakes.py: it takes batches and keeps beating."""

from __future__ import annotations

import time

import msgpack
import pytest
from tests.harness.fakes import FakeConsumer, FakeProducer, Rejected

from dflash.broker.config import BrokerConfig

pytestmark = pytest.mark.integration


def test_a_consumer_that_beats_but_never_acks_loses_its_batches_to_another(brokers):
    b = brokers("--ack-timeout-s", "2", "--lease-size", "4")
    prod = FakeProducer(b.control, "p", n_samples=4, per_batch=1)
    hog = FakeConsumer(b.control, "hog")
    hog.send("credit", credit=8)
    prod.run_to_end()  # the pool is made: 4 one-sample batches, all delivered to the hog
    taken, t0 = [], time.monotonic()
    with pytest.raises(Rejected, match="unknown_peer"):
        while time.monotonic() - t0 < 20:  # beats, takes, never acks
            hog.pump()
            if hog.data.poll(20):
                taken.append(msgpack.unpackb(hog.data.recv_multipart()[0])["batch_id"])
    assert len(taken) == 4
    ev = b.wait_event("broker.ack_overdue")
    assert ev["peer"] == hog.peer and ev["in_flight"] == 4 and ev["deadline_s"] == 2
    # the line's own `instance` is the broker's; the consumer's is `peer_instance` (docs/LOGS.md)
    assert ev["role"] == "broker" and ev["instance"] == "main" and ev["peer_instance"] == "hog"
    assert 2 <= ev["waited_s"] < 5
    lost = b.wait_event("broker.peer_lost", pred=lambda e: e["peer"] == hog.peer)
    assert lost["held"]["in_flight"] == 4 and "no ack" in lost["reason"]

    good = FakeConsumer(b.control, "good")
    good.run_to_end(max_s=20)  # trains the requeued batches; the stream ends
    assert sorted(r["batch_id"] for r in good.received) == sorted(taken)
    assert good.stopped == "end_of_stream"


def test_the_default_deadline_is_above_the_consumers_own_waits_and_their_steps():
    assert BrokerConfig().ack_deadline(0.0) == 120.0  # an elastic start waits 60 s, a quorum 60 s
    assert BrokerConfig(timeout_s=30).ack_deadline(0.0) == 360.0
    assert BrokerConfig().ack_deadline(50.0) == 200.0  # a consumer whose steps take 50 s
    assert BrokerConfig(ack_timeout_s=7).ack_deadline(50.0) == 7.0
    with pytest.raises(ValueError, match="--ack-timeout-s"):
        BrokerConfig(ack_timeout_s=-1).check()
