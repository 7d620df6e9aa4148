"""Prefetch: a background thread turns leases into packed batches ahead of the GPU.

The queue is bounded, so a GPU-bound producer stops asking for leases it cannot serve soon;
`revoke` gives back batches not yet taken (PROTOCOL.md 4.3) to a producer with nothing to make."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

from dflash.protocol.batch import Batch
from dflash.runtime.threads import name_this_thread


@dataclass
class Lease:
    """Work from the broker: sample IDs of one epoch, in the broker's order."""

    lease: int
    epoch: int
    samples: list[int]


@dataclass
class Item:
    """What the prefetch thread hands over, in order: batches of a lease, then its end."""

    kind: str  # "batch" | "lease_end" | "end" | "error"
    batch: Batch | None = None
    lease: Lease | None = None
    skipped: list[tuple[int, str]] = field(default_factory=list)
    error: BaseException | None = None


class Prefetcher:
    """`prepare(lease) -> (batches, skipped)` run ahead on a thread, `depth` batches deep."""

    def __init__(self, next_lease: Callable[[], Lease | None],
                 prepare: Callable[[Lease], tuple[list[Batch], list[tuple[int, str]]]],
                 depth: int = 4):
        self.next_lease, self.prepare = next_lease, prepare
        self._q: queue.Queue[Item] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._batches = 0  # batches in the queue (lease_end markers also take slots)
        self._count_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="dflash-prefetch", daemon=True)
        self.state = "idle"
        # lease -> its batches not yet taken, in order (revoked ones skipped by identity)
        self._untaken: dict[int, list[Batch]] = {}
        self._revoked: set[int] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    def depth(self) -> int:
        return self._batches

    def get(self) -> Item:
        """The next item; blocks until the thread has one. Batches given back are skipped."""
        while True:
            item = self._q.get()
            if item.kind == "batch":
                with self._count_lock:
                    self._batches -= 1
                if not self._take(item.batch):
                    continue
            elif item.kind == "lease_end":
                with self._lock:
                    self._untaken.pop(item.lease.lease, None)
            return item

    def _take(self, b: Batch) -> bool:
        """Whether batch `b` is still ours to make (not given back); from now on it is started."""
        with self._lock:
            if id(b) in self._revoked:
                self._revoked.discard(id(b))
                return False
            untaken = self._untaken.get(b.lease)
            if untaken:
                self._untaken[b.lease] = [x for x in untaken if x is not b]
            return True

    def revoke(self, lease: int, n: int) -> list[int]:
        """Give back up to `n` samples of `lease` in whole untaken batches, last first; their samples."""
        out: list[int] = []
        with self._lock:
            untaken = self._untaken.get(lease, [])
            while untaken and len(out) + len(untaken[-1].samples) <= n:
                b = untaken.pop()
                self._revoked.add(id(b))
                out = b.samples + out
        return out

    def _put(self, item: Item) -> bool:
        # Count before the put: the consumer may take it (and decrement) at once.
        delta = 1 if item.kind == "batch" else 0
        with self._count_lock:
            self._batches += delta
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        with self._count_lock:
            self._batches -= delta
        return False

    def _loop(self) -> None:
        name_this_thread("dflash-prefetch")
        try:
            while not self._stop.is_set():
                self.state = "waiting_lease"
                lease = self.next_lease()
                if lease is None:
                    self.state = "done"
                    self._put(Item("end"))
                    return
                self.state = "preparing"
                batches, skipped = self.prepare(lease)
                if isinstance(batches, list):
                    with self._lock:
                        self._untaken[lease.lease] = list(batches)
                for b in batches:
                    with self._lock:
                        if id(b) in self._revoked:  # given back before it was queued
                            self._revoked.discard(id(b))
                            continue
                    if not self._put(Item("batch", batch=b)):
                        return
                if not self._put(Item("lease_end", lease=lease, skipped=skipped)):
                    return
        except BaseException as e:  # handed to the main thread, which raises it
            self.state = "failed"
            self._put(Item("error", error=e))
