"""The producer's policy on its broker link (protocol/links.py `ProducerLink`): how big a
lease to ask for, how to wait for work, and how a signal stops a blocked push (the outbox
blocking is the broker's backpressure reaching the GPU loop). The wire stays in the link."""

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
    """Leases of `want` samples from the broker, until no work is left or `stop` is set."""

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
        """Epoch 1's sample order as the broker leases it, for --regenerate to work ahead (or None)."""
        cfg = self.link.welcome.run_config
        if cfg is None or cfg.dataset is None:
            return None
        return epoch_order(cfg.seed, 0, cfg.dataset.n_samples)


def failure(e: BaseException) -> Failed:
    """What a producer stopping on `e` tells the broker (PROTOCOL.md 4.2), so status says why it left."""
    if isinstance(e, BadRow):
        return Failed("bad_row", str(e)[:2000], source=e.source,
                      hint=f"fix or remove the row at {e.source} and restart the producer, or restart it with "
                           "--skip-bad-rows (bad rows are then skipped and reported, never trained)")
    return Failed("error", f"{type(e).__name__}: {str(e)[:2000]}")


def link_sink(link, stop: threading.Event | None = None) -> BatchSink:
    """Push to the link; under backpressure raise Stopped once `stop` is set (samples go back with `bye`)."""
    def push(batch: Batch) -> None:
        while True:
            try:
                return link.push_batch(batch, timeout_s=None if stop is None else 0.5)
            except TimeoutError:
                if stop.is_set():
                    raise Stopped("stopped by a signal while the broker's queue was full") from None
    return push
