"""The producer's policy on its broker link (protocol/links.py `ProducerLink`): how big a
lease to ask for, how to wait for work, and how a signal stops a blocked push. The wire
(lease asks, grants, batches, `done`) stays in the link.

`BrokerWorkSource` turns `grant`s into leases (an empty grant without `end` means "ask
again after `retry_ms`"); `link_sink` pushes batches, blocking while the link's outbox is
full: that is the broker's backpressure reaching the GPU loop; `failure` is what a producer
that stops on an error tells the broker before it leaves.
"""

from __future__ import annotations

import threading
import time

from dflash.protocol.batch import Batch
from dflash.protocol.messages import Failed
from dflash.protocol.sample_order import epoch_order

from .data import BadRow
from .prefetch import Lease
from .producer import BatchSink


class Stopped(Exception):
    """A signal asked the producer to stop while a batch waited for room in the outbox."""


class BrokerWorkSource:
    """Leases of `want` samples from the broker, until it says there is no work left (or
    `stop` is set: a signal asked us to leave)."""

    def __init__(self, link, want: int, stop: threading.Event | None = None):
        self.link, self.want, self.stop = link, want, stop or threading.Event()

    def next_lease(self) -> Lease | None:
        while not self.link.stopped.is_set() and not self.stop.is_set():
            grant = self.link.request_lease(self.want)
            if grant.samples:
                return Lease(grant.lease, grant.epoch, list(grant.samples))
            if grant.end:
                return None
            time.sleep(max(0.05, (grant.retry_ms if grant.retry_ms is not None else 500) / 1000))
        return None

    def lease_done(self, lease: int, skipped: list[tuple[int, str]]) -> None:
        self.link.lease_done(lease, skipped)

    def order(self) -> list[int] | None:
        """Epoch 1's sample order as the broker leases it (its shuffle of the welcome's seed
        and dataset size), for --regenerate to work ahead; None if the welcome lacks them."""
        cfg = self.link.welcome.run_config
        if cfg is None or cfg.dataset is None:
            return None
        return epoch_order(cfg.seed, 0, cfg.dataset.n_samples)


def failure(e: BaseException) -> Failed:
    """What a producer that stops on `e` tells the broker before its `bye` (PROTOCOL.md 4.2):
    for a bad row its file and line and the fix, so that the run's status says why its
    producer left instead of "no target connected"."""
    if isinstance(e, BadRow):
        return Failed("bad_row", str(e)[:2000], source=e.source,
                      hint=f"fix or remove the row at {e.source} and restart the producer, or restart it with "
                           "--skip-bad-rows (bad rows are then skipped and reported, never trained)")
    return Failed("error", f"{type(e).__name__}: {str(e)[:2000]}")


def link_sink(link, stop: threading.Event | None = None) -> BatchSink:
    """Push to the link; while backpressure holds a batch, look at `stop` every 0.5 s and
    raise Stopped once set (the batch is dropped: its samples go back with `bye`)."""
    def push(batch: Batch) -> None:
        while True:
            try:
                return link.push_batch(batch, timeout_s=None if stop is None else 0.5)
            except TimeoutError:
                if stop.is_set():
                    raise Stopped("stopped by a signal while the broker's queue was full") from None
    return push
