"""The core's part for work leases (PROTOCOL.md 4.3): grants, `done`, incomplete and given-back
leases; leases.py's `LeasePool` keeps the order, this part the ledger rows and log lines.
"""

from __future__ import annotations

from dflash.protocol.messages import Done, Grant, LeaseAsk, Release, Revoke
from dflash.runtime.logs import get_logger

from .config import BrokerConfig
from .leases import Lease, LeasePool
from .ledger import Ledger
from .peers import ProducerHeld, ProducerSession

log = get_logger()

RETRY_MS = 500  # "nothing to lease now, ask again in" (grant.retry_ms)


class Work:
    def __init__(self, cfg: BrokerConfig, pool: LeasePool, ledger: Ledger):
        self.cfg, self.pool, self.ledger = cfg, pool, ledger

    def grant(self, p: ProducerSession, m: LeaseAsk, producers: int, ending: bool, elastic: bool) -> Grant:
        """`p`'s grant: a share of what is left, or empty (`end` once nothing more can be asked for)."""
        pool = self.pool
        epoch_before = pool.epoch
        size = min(m.want, self.cfg.lease_size, pool.share(producers))
        lease = None if ending else pool.grant(p.id, size)
        if lease is None:
            # not the end while elastic consumers may send samples back, or a re-plan may grow the budget
            end = ending or (pool.finished() and not pool.capped and not elastic)
            return Grant(0, pool.epoch, [], end, retry_ms=RETRY_MS)
        if pool.epoch != epoch_before or lease.id == 1:
            self.ledger.epoch_started(pool.epoch, self.cfg.seed, pool.n_samples)
            log.info("broker.epoch_started", epoch=pool.epoch, epochs=self.cfg.epochs, n_samples=pool.n_samples)
        self.ledger.leased(lease.id, lease.epoch, p.id, lease.samples)
        log.info("broker.lease_granted", lease=lease.id, peer=p.id, epoch=lease.epoch, n=len(lease.samples),
                 want=m.want, pending=pool.pending())
        return Grant(lease.id, lease.epoch, lease.samples, False)

    def split_for(self, asker: ProducerSession, producers: dict[str, ProducerSession],
                  now: float) -> tuple[ProducerSession, Revoke] | None:
        """`asker` has nothing and the pool is empty: (the producer of the biggest open lease, a `revoke`
        of half of it), or None."""
        if self.pool.pending() or self.pool.open_leases(asker.id):
            return None
        lease = self.pool.to_split(asker.id, lambda pid: pid in producers and producers[pid].said.revoke, now,
                                   self.cfg.timeout_s)
        if lease is None:
            return None
        lease.revoked_at = now
        n = len(lease.outstanding) // 2
        log.info("broker.lease_revoke", lease=lease.id, peer=lease.producer, n=n, outstanding=len(lease.outstanding),
                 asker=asker.id)
        return producers[lease.producer], Revoke(lease.id, n)

    def released(self, p: ProducerSession, m: Release) -> None:
        """`p` will not make `m.samples` of its lease: they go to the front of the pool."""
        lease = self.pool.open.get(m.lease)
        if lease is None or lease.producer != p.id:
            log.debug("broker.release_ignored", peer=p.id, lease=m.lease)
            return
        lease.revoked_at = None
        back = self.pool.give_up(lease, m.samples)
        if back:
            self.ledger.released(lease.epoch, back)
        log.info("broker.lease_split", lease=lease.id, peer=p.id, n=len(back), samples=back[:16],
                 left=len(lease.outstanding), pending=self.pool.pending())
        self.finish(lease)

    def done(self, p: ProducerSession, m: Done, now: float) -> None:
        """`p` made what it could of a lease: skips recorded; it closes once its last batch is in."""
        lease = self.pool.open.get(m.lease)
        if lease is None or lease.producer != p.id:
            log.debug("broker.done_ignored", peer=p.id, lease=m.lease)
            return
        skipped = self.pool.skip(lease, m.skipped)
        if skipped:
            self.ledger.skipped(lease.epoch, skipped)
            log.info("broker.samples_skipped", peer=p.id, lease=lease.id, n=len(skipped),
                     first=[list(x) for x in skipped[:8]])
        lease.done_at = now
        self.finish(lease)

    def finish(self, lease: Lease) -> None:
        """Close `lease` if every sample of it arrived or was skipped."""
        if self.pool.close_if_complete(lease):
            self.ledger.lease_closed(lease.id, "done")
            log.info("broker.lease_done", lease=lease.id, peer=lease.producer, epoch=lease.epoch,
                     n=len(lease.samples), skipped=lease.skipped)

    def incomplete(self, now: float) -> None:
        """Leases whose `done` came long ago but whose samples never arrived: made again elsewhere."""
        for lease in self.pool.overdue(now, self.cfg.timeout_s):
            back = self.pool.give_back(lease)
            self.ledger.released(lease.epoch, back)
            self.ledger.lease_closed(lease.id, "incomplete")
            log.warning("broker.lease_incomplete", lease=lease.id, peer=lease.producer, missing=len(back),
                        samples=back[:16], waited_s=round(self.cfg.timeout_s, 1))

    def release(self, p: ProducerSession) -> ProducerHeld:
        """A producer's session ended: its open leases go back to the front of the pool."""
        returned = self.pool.release(p.id)
        for lease, back in returned:
            self.ledger.released(lease.epoch, back)
            self.ledger.lease_closed(lease.id, "returned")
        return ProducerHeld([le.id for le, _ in returned], sum(len(x) for _, x in returned), p.batches_in)

    def remake(self, epoch: int, samples: list[int]) -> None:
        """Samples go back to the front of the pool to be made again; the caller moves the ledger rows."""
        self.pool.rewind(epoch, samples)
