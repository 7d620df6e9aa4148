"""`Prefetcher.revoke` (issue 36 item 3): a lease's batches not yet taken by the main thread
are given back from the lease's end, in whole batches, never more than asked; those taken
are the producer's to make; a given-back batch never reaches the main thread."""

from __future__ import annotations

import time

import pytest
import torch

from dflash.producers.prefetch import Lease, Prefetcher
from dflash.protocol.batch import Batch

pytestmark = pytest.mark.unit


def batches(lease: Lease, per: int) -> list[Batch]:
    groups = [lease.samples[i:i + per] for i in range(0, len(lease.samples), per)]
    return [Batch.packed(g, [1] * len(g), torch.zeros(len(g), dtype=torch.int32), torch.zeros(len(g), dtype=torch.uint8),
                         lease=lease.lease, epoch=lease.epoch) for g in groups]


def test_revoke_gives_back_whole_untaken_batches_from_the_end_and_they_never_come_out():
    leases = [Lease(1, 0, list(range(12)))]
    pf = Prefetcher(lambda: leases.pop() if leases else None, lambda le: (batches(le, 2), []), depth=2)
    pf.start()
    try:
        first = pf.get()  # taken: started, no longer ours to give back
        assert first.batch.samples == [0, 1]
        deadline = time.monotonic() + 5
        while pf.depth() < 2 and time.monotonic() < deadline:  # two more queued, not taken
            time.sleep(0.01)
        assert pf.revoke(1, 5) == [8, 9, 10, 11]  # whole batches only: 4 of the 5 asked
        assert pf.revoke(2, 5) == []  # a lease it does not hold
        got = []
        while (item := pf.get()).kind == "batch":
            got.extend(item.batch.samples)
        assert item.kind == "lease_end" and got == [2, 3, 4, 5, 6, 7]
        assert pf.revoke(1, 10) == []  # the lease is over
        assert pf.get().kind == "end"
    finally:
        pf.stop()
