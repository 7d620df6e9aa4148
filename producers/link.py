"""The producer's two plugs onto the broker link (protocol/peer.py `PeerLink`).

`BrokerWorkSource` turns `grant`s into leases (an empty grant without `end` means "ask
again after `retry_ms`"); `link_sink` pushes batches, blocking while the link's outbox is
full: that is the broker's backpressure reaching the GPU loop.
"""

from __future__ import annotations

import time

from .prefetch import Lease
from .producer import BatchSink


class BrokerWorkSource:
    """Leases of `want` samples from the broker, until it says there is no work left."""

    def __init__(self, link, want: int):
        self.link, self.want = link, want

    def next_lease(self) -> Lease | None:
        while not self.link.stopped.is_set():
            grant = self.link.request_lease(self.want)
            if grant["samples"]:
                return Lease(int(grant["lease"]), int(grant["epoch"]), [int(s) for s in grant["samples"]])
            if grant["end"]:
                return None
            time.sleep(max(0.05, grant.get("retry_ms", 500) / 1000))
        return None

    def lease_done(self, lease: int, skipped: list[tuple[int, str]]) -> None:
        self.link.lease_done(lease, skipped)


def link_sink(link) -> BatchSink:
    def push(fields: dict, tensors: dict) -> str:
        return link.push_batch(fields, tensors)
    return push
