"""Backpressure (zguide lbbroker): with no consumer, the broker stops reading data in
once its queue is full, the producer's sends block, and nothing is lost or timed out
meanwhile; a consumer then drains everything."""

from __future__ import annotations

import threading
import time

from tests.harness.fakes import FakeConsumer, FakeProducer, batch_frames
import pytest

pytestmark = pytest.mark.integration

# What the queue counts for one batch: every frame, header included (a header may carry
# unknown fields, so it is held memory too). 2 samples x 4 tokens: int32 ids 32 B + uint8
# mask 8 B + bf16 [8, 8] 128 B + the header (same length for batch IDs p1-1..p1-9).
BATCH_BYTES = sum(map(len, batch_frames("20260101T000000Z-abcd", "p1", "p1-1", 1, 0, [0, 1])))


def test_full_queue_stops_reading_and_producers_wait_without_losing_anything(start_broker):
    b = start_broker("--queue-bytes", str(3 * BATCH_BYTES - 1), "--lease-size", "8")
    prod = FakeProducer(b.control, "t0", n_samples=60, per_batch=2)
    t = threading.Thread(target=prod.run_to_end)
    t.start()
    time.sleep(2.5)  # longer than --timeout-s 1.5: a held `done` must not expire meanwhile
    st = b.ask()
    assert st["queue"]["batches"] == 3 and not st["queue"]["reading"]  # 3rd batch filled it
    assert st["queue"]["bytes"] == 3 * BATCH_BYTES
    assert [p["peer"] for p in st["peers"]] == ["p1"]  # the blocked producer is alive
    assert st["rates"]["batches_in"] == 3
    cons = FakeConsumer(b.control, "c0")
    cons.run_to_end(max_s=20)
    t.join(10)
    assert b.proc.wait(10) == 0
    assert sorted(s for r in cons.received for s in r["samples"]) == list(range(60))
    assert not b.events("broker.lease_incomplete") and not b.events("broker.batch_stale")
    assert not b.events("broker.peer_lost")
