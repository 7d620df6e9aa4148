"""Demand-driven dispatch: one shared queue bounded in bytes, credit per consumer.

A batch goes only against credit, to the consumer served least recently (PROTOCOL.md 4.5), so a
slow consumer never holds batches it did not ask for and a fast one never waits behind it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Iterable, Protocol

from dflash.protocol.batch import Batch

from .config import MAX_UNACKED


@dataclass(eq=False)
class Queued:
    """A validated batch the broker holds (queued, or delivered and not yet acked), with its bookkeeping."""

    batch: Batch
    nbytes: int  # header and tensor frames: what the queue's byte bound counts
    queued_at: float  # monotonic
    deliveries: int = 0  # >1 once a lost consumer returned it
    failures: list[str] = field(default_factory=list)  # consumers that failed on it (quarantine.py)

    @property
    def batch_id(self) -> str:
        return self.batch.batch_id


class Consumer(Protocol):
    """What dispatch needs of a consumer session (peers.ConsumerSession has it)."""

    credit: int
    last_served: int
    in_flight: OrderedDict
    progress_at: float


class BatchQueue:
    """FIFO of batches bounded in bytes, in flight included (or consumers that never ack would let the
    broker hold far more than `capacity`); the loop reads data in while `has_room`."""

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.bytes = 0
        self.in_flight_bytes = 0
        self._q: deque[Queued] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def has_room(self) -> bool:
        # one message may overshoot by its own size: the loop stops reading as soon as this is False
        return self.bytes + self.in_flight_bytes < self.capacity

    def push(self, b: Queued) -> None:
        self._q.append(b)
        self.bytes += b.nbytes

    def push_front(self, batches: Iterable[Queued]) -> None:
        """Requeue batches ahead of everything, keeping their own order (oldest first)."""
        for b in reversed(list(batches)):
            self._q.appendleft(b)
            self.bytes += b.nbytes

    def peek(self) -> Queued:
        return self._q[0]

    def pop(self) -> Queued:
        """Take the head batch out to deliver it: it stays held (in flight) until released."""
        b = self._q.popleft()
        self.bytes -= b.nbytes
        self.in_flight_bytes += b.nbytes
        return b

    def release(self, b: Queued) -> None:
        """An in-flight batch was acked: the broker no longer holds it."""
        self.in_flight_bytes -= b.nbytes

    def requeue(self, batches: Iterable[Queued]) -> None:
        """In-flight batches of a lost consumer go back to the front, oldest first."""
        batches = list(batches)
        self.in_flight_bytes -= sum(b.nbytes for b in batches)
        self.push_front(batches)

    def oldest_age(self, now: float) -> float:
        if not self._q:
            return 0.0
        return now - self._q[0].queued_at


_serve_clock = itertools.count(1)


def wants_batch(c: Consumer) -> bool:
    return c.credit > 0 and len(c.in_flight) < MAX_UNACKED


class Round:
    """One round of dispatch: `offer()` pairs the least recently served consumer with the head batch;
    `took` records the send, `refused` keeps the batch at the head and that consumer sits the round out."""

    def __init__(self, queue: BatchQueue, consumers: Iterable[Consumer]):
        self.queue, self.consumers = queue, list(consumers)
        self.ready = [c for c in self.consumers if wants_batch(c)]

    def offer(self) -> tuple[Consumer, Queued] | None:
        if not (self.queue and self.ready):
            return None
        return min(self.ready, key=lambda x: x.last_served), self.queue.peek()  # waited longest, oldest

    def refused(self, c: Consumer) -> None:
        self.ready.remove(c)

    def took(self, c: Consumer, now: float) -> Queued:
        b = self.queue.pop()
        if not c.in_flight:  # the ack deadline runs from here (sessions.overdue_acks)
            c.progress_at = now
        c.credit -= 1
        c.last_served = next(_serve_clock)
        c.in_flight[b.batch_id] = b
        b.deliveries += 1
        if not wants_batch(c):
            self.ready.remove(c)
        return b
