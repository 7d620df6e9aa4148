"""Work leases: which samples each producer makes, epoch by epoch (PROTOCOL.md 4.3).

Producers lease ranges of each epoch's order (shuffled from --seed and epoch; a resume leaves out
what its parents committed). Samples given back go to the *front* of the pool, made next.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dflash.protocol.sample_order import epoch_order

# Open leases per producer: one producer cannot drain the pool ahead of what it can make.
MAX_OPEN_LEASES = 4


class StaleBatch(Exception):
    """A batch that no open lease expects (lost producer, resent, or wrong samples)."""


@dataclass(eq=False)
class Lease:
    id: int
    producer: str
    epoch: int
    samples: list[int]
    outstanding: set[int]
    done_at: float | None = None  # when the producer said `done`
    skipped: int = 0
    revoked_at: float | None = None  # when a `revoke` of part of it went out, unanswered


class LeasePool:
    """The samples still to make and the leases out; `committed`: epoch -> bitmap of samples never leased again."""

    def __init__(self, epochs: int, seed: int, n_samples: int | None = None,
                 committed: dict[int, bytearray] | None = None):
        self.epochs, self.seed = epochs, seed
        self.committed = committed or {}
        self._committed_n: dict[int, int] = {}
        self.n_samples: int | None = None
        self.epoch = 0  # the epoch the cursor is in
        self._order: list[int] = []
        self._cursor = 0
        self._returned: deque[tuple[int, int]] = deque()  # (epoch, sample), leased first
        # samples taken from the epochs' orders, and the most that may be (--time-budget's plan)
        self.taken = 0
        self.limit: int | None = None
        self.open: dict[int, Lease] = {}
        self._next_id = 1
        if n_samples is not None:
            self.set_dataset(n_samples)

    def set_dataset(self, n_samples: int) -> None:
        """Fix the dataset size; ValueError if a committed bitmap has another size."""
        if any(len(m) != n_samples for m in self.committed.values()):
            raise ValueError(f"committed samples were recorded for another dataset size than {n_samples}")
        self.n_samples = n_samples
        # pending() runs every loop turn: count each epoch's committed samples once here
        self._committed_n = {e: m.count(1) for e, m in self.committed.items()}
        self.epoch, self._order, self._cursor = 0, self._order_of(0), 0

    def _order_of(self, epoch: int) -> list[int]:
        """Epoch `epoch`'s shuffled order without the samples committed before this run."""
        order = epoch_order(self.seed, epoch, self.n_samples)
        done = self.committed.get(epoch)
        return order if done is None else [s for s in order if not done[s]]

    def _left(self, epoch: int) -> int:
        return self.n_samples - self._committed_n.get(epoch, 0)

    @property
    def known(self) -> bool:
        return self.n_samples is not None

    def pending(self) -> int:
        """Samples not yet leased in the whole run."""
        if self.n_samples is None:
            return 0
        later = sum(self._left(e) for e in range(self.epoch + 1, self.epochs))
        return len(self._returned) + self._fresh(len(self._order) - self._cursor + later)

    def _fresh(self, left: int) -> int:
        """Of `left` samples not yet taken from the orders, those the limit allows."""
        return left if self.limit is None else max(0, min(left, self.limit - self.taken))

    @property
    def capped(self) -> bool:
        """Samples are left to lease that only the limit keeps back (so it may yet grow)."""
        if self.limit is None or self.n_samples is None:
            return False
        later = sum(self._left(e) for e in range(self.epoch + 1, self.epochs))
        return len(self._order) - self._cursor + later > self._fresh(len(self._order) - self._cursor + later)

    def finished(self) -> bool:
        """Every sample of every epoch arrived or was skipped."""
        return self.known and self.pending() == 0 and not self.open

    def open_leases(self, producer: str) -> list[Lease]:
        return [le for le in self.open.values() if le.producer == producer]

    def share(self, producers: int) -> int:
        """The most samples one lease may take now: what is left split over the live `producers`,
        so the first producer of a small dataset cannot take all of it and the tail spreads."""
        return max(1, -(-self.pending() // max(1, producers)))

    def grant(self, producer: str, want: int) -> Lease | None:
        """Lease up to `want` samples of one epoch; None when there is nothing now."""
        if not self.known or want <= 0 or len(self.open_leases(producer)) >= MAX_OPEN_LEASES:
            return None
        epoch, samples = self._take(want)
        if not samples:
            return None
        lease = Lease(self._next_id, producer, epoch, samples, set(samples))
        self._next_id += 1
        self.open[lease.id] = lease
        return lease

    def _take(self, want: int) -> tuple[int, list[int]]:
        if self._returned:  # returned samples first, one epoch per lease
            epoch = self._returned[0][0]
            out = []
            while self._returned and len(out) < want and self._returned[0][0] == epoch:
                out.append(self._returned.popleft()[1])
            return epoch, out
        # `while`: a resume may have committed whole epochs; an epoch starts only within the limit
        while self._cursor >= len(self._order) and self.epoch + 1 < self.epochs and self._fresh(1):
            self.epoch += 1
            self._order, self._cursor = self._order_of(self.epoch), 0
        out = self._order[self._cursor:self._cursor + self._fresh(want)]
        self._cursor += len(out)
        self.taken += len(out)
        return self.epoch, out

    def arrived(self, lease_id: int, producer: str, epoch: int, samples: list[int]) -> Lease:
        """Record a batch's samples. Raises StaleBatch (recording nothing) if any is unexpected."""
        lease = self.open.get(lease_id)
        if lease is None:
            raise StaleBatch(f"lease {lease_id} is not open")
        if lease.producer != producer or lease.epoch != epoch:
            raise StaleBatch(f"lease {lease_id} belongs to {lease.producer} epoch {lease.epoch}")
        if len(set(samples)) != len(samples) or not lease.outstanding.issuperset(samples):
            raise StaleBatch(f"samples already received or not in lease {lease_id}")
        lease.outstanding.difference_update(samples)
        return lease

    def skip(self, lease: Lease, pairs: list) -> list[tuple[int, str]]:
        """Mark [sample, reason] pairs skipped; returns the ones the lease still expected."""
        out = []
        for p in pairs:
            if isinstance(p, list) and len(p) == 2 and p[0] in lease.outstanding:
                lease.outstanding.discard(p[0])
                out.append((p[0], str(p[1])[:200]))
        lease.skipped += len(out)
        return out

    def close_if_complete(self, lease: Lease) -> bool:
        if lease.outstanding:
            return False
        del self.open[lease.id]
        return True

    def give_back(self, lease: Lease) -> list[int]:
        """Close `lease`; its samples not yet arrived go to the front of the pool."""
        back = [s for s in lease.samples if s in lease.outstanding]
        self._returned.extendleft((lease.epoch, s) for s in reversed(back))
        self.open.pop(lease.id, None)
        return back

    def to_split(self, asker: str, can_revoke, now: float, wait_s: float) -> Lease | None:
        """Another revocable producer's open lease with the most samples to come (>= 2, none revoked in
        `wait_s`): part of it may move to `asker`, who has nothing. None if none."""
        best = None
        for le in self.open.values():
            if le.producer == asker or len(le.outstanding) < 2 or not can_revoke(le.producer):
                continue
            if le.revoked_at is not None and now - le.revoked_at < wait_s:
                continue
            if best is None or len(le.outstanding) > len(best.outstanding):
                best = le
        return best

    def give_up(self, lease: Lease, samples: list) -> list[int]:
        """Samples its producer will not make (`release`): the outstanding ones go to the pool's front."""
        named = {s for s in samples if isinstance(s, int)}
        back = [s for s in lease.samples if s in named and s in lease.outstanding]
        lease.outstanding.difference_update(back)
        lease.samples = [s for s in lease.samples if s not in set(back)]
        self._returned.extendleft((lease.epoch, s) for s in reversed(back))
        return back

    def rewind(self, epoch: int, samples: list[int]) -> None:
        """Trained samples whose weights were left behind (lineage.py) go to the pool's front."""
        self._returned.extendleft((epoch, s) for s in reversed(samples))

    def release(self, producer: str) -> list[tuple[Lease, list[int]]]:
        """Give back every open lease of a lost producer, oldest lease's samples first."""
        mine = sorted(self.open_leases(producer), key=lambda le: le.id, reverse=True)
        out = [(le, self.give_back(le)) for le in mine]  # newest first onto the front...
        return out[::-1]  # ...so the oldest ends up at the very front; report oldest first

    def hold_clocks(self, dt: float) -> None:
        """Stop the `done` clocks for `dt`: with the queue full, a lease's last batches wait through no
        fault of their producer's."""
        for le in self.open.values():
            if le.done_at is not None:
                le.done_at += dt

    def overdue(self, now: float, grace_s: float) -> list[Lease]:
        """Leases whose producer said `done` more than `grace_s` ago yet are incomplete."""
        return [le for le in self.open.values() if le.done_at is not None and now - le.done_at > grace_s]
