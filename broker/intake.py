"""Batches arriving on data in (PROTOCOL.md 4.4): validate, accept or drop, enqueue.

Only a live producer's batch for a lease it holds, with samples not yet received, is accepted;
the rest is stale, so a producer declared lost cannot put a sample in twice. A misfit batch ends
its producer's session only when it came on that producer's own connection (`producer` is anyone's to write).
"""

from __future__ import annotations

from dflash.protocol.messages import Reject
from dflash.protocol.batch import Batch
from dflash.runtime.logs import get_logger

from .actions import Outbox
from .config import BrokerConfig
from .delivery import Delivery
from .dispatch import Queued
from .facts import RunFacts
from .fit import Misfit, misfit
from .inbound import Arrival, connection_fields
from .leases import StaleBatch
from .ledger import Ledger
from .peers import Failure, ProducerSession, Session
from .quarantine import Poison
from .replies import MAX_REASON, Replies, clip
from .work import Work

log = get_logger()


class Intake:
    def __init__(self, cfg: BrokerConfig, facts: RunFacts, work: Work, delivery: Delivery, ledger: Ledger,
                 poison: Poison, replies: Replies, out: Outbox):
        self.cfg, self.facts, self.work, self.delivery = cfg, facts, work, delivery
        self.ledger, self.poison, self.replies, self.out = ledger, poison, replies, out
        # batch IDs accepted in this run: a reused one would overwrite the first's ledger row
        self.accepted_ids: set[str] = set()

    def accept(self, a: Arrival, named: Session | None, now: float) -> str | None:
        """One batch the codec passed; `named`: the session its `producer` names. Returns why that
        session must end (a misfit batch), else None; never raises on bad input."""
        m = a.batch
        if a.payload_bytes > self.cfg.max_message_bytes:
            return self.too_large(m, a.payload_bytes, named, now)
        p = named if isinstance(named, ProducerSession) else None
        try:
            if p is None:
                raise StaleBatch(f"producer {m.producer!r} has no live session")
            if m.batch_id in self.delivery.batch_ids:
                raise StaleBatch(f"batch_id {m.batch_id!r} is already queued or in flight")
            if m.batch_id in self.accepted_ids:
                return self.rejected(a, p, Misfit("batch_id_reused", f"batch_id {m.batch_id!r} was accepted before in "
                                                  "this run (the ledger holds it): batch IDs are unique in a run"),
                                     now, code="duplicate_batch_id")
            bad = misfit(self.facts.facts, a)
            if bad is not None:  # before its samples count as received: a correct copy may follow
                return self.rejected(a, p, bad, now)
            lease = self.work.pool.arrived(m.lease, p.id, m.epoch, m.samples)
        except StaleBatch as e:
            return self.stale(a, named, str(e), now)
        p.last_seen = now  # data counts as a sign of life too
        # the header counts too: with unknown fields allowed it may outweigh the tensors
        q = Queued(m, a.payload_bytes + a.header_bytes, now)
        self.delivery.push(q, now)
        self.accepted_ids.add(m.batch_id)
        p.batches_in += 1
        p.bytes_in += q.nbytes
        p.samples_in += len(m.samples)
        p.rate_in.add(1, now)
        p.rate_tokens.add(m.tokens, now)
        self.work.finish(lease)
        return None

    def too_large(self, m: Batch, payload: int, named: Session | None, now: float) -> None:
        """A batch over --max-message-bytes: dropped, logged, and its live producer told (`too_large`) so it
        stops making batches the broker drops."""
        limit = self.cfg.max_message_bytes
        producer, batch_id = clip(m.producer, 64), clip(m.batch_id, 64)
        ok, suppressed = self.replies.allow(f"too_large:{producer}", now)
        if ok:
            log.warning("broker.batch_too_large", producer=producer, batch_id=batch_id,
                        bytes=payload, limit=limit, suppressed=suppressed)
        if named is not None:
            self.replies.reply(named.identity, Reject(
                f"batch {batch_id} is {payload} tensor bytes, over this broker's --max-message-bytes {limit}: "
                "dropped; lower --token-budget or --max-batch-size, or raise the broker's --max-message-bytes",
                "too_large", answers={"type": "batch", "batch_id": batch_id}), now)

    def rejected(self, a: Arrival, p: ProducerSession, bad: Misfit, now: float, code: str = "bad_batch") -> str | None:
        """A batch from `p` that does not fit the run (or reuses a batch ID): dropped, counted, logged; on
        `p`'s own connection `p` is told and its session ends, as every batch it makes would be wrong."""
        m, conn = a.batch, a.conn
        own = from_own_connection(p, conn)
        self.poison.count("rejected", bad.fault, len(m.samples))
        self.ledger.rejected(m, bad.fault, bad.reason)
        batch_id = clip(m.batch_id, 64)
        ok, suppressed = self.replies.allow(f"rejected:{p.id}", now)
        if ok:
            log.warning("broker.batch_rejected", batch_id=batch_id, lease=m.lease, epoch=m.epoch,
                        samples=len(m.samples), fault=bad.fault, reason=bad.reason, **p.describe(),
                        own_connection=own, **connection_fields(conn), suppressed=suppressed)
        if not own:  # anyone may write `producer`: the named session and its lease stay as they are
            return None
        if code == "bad_batch":
            said = (f"batch {batch_id} does not fit this run's target: {bad.reason}; refused, and this producer's "
                    "session is ended (its leases go to other producers): check --target and --target-layers against "
                    "the run's")
            failure = Failure(code, f"sent batch {batch_id} that does not fit the run: {bad.reason}",
                              "start it with the run's --target and --target-layers (dflash-status shows the run's "
                              "facts)", batch_id=batch_id, fault=bad.fault)
        else:
            said = (f"batch {batch_id} refused: {bad.reason}; this producer's session is ended (its leases go to "
                    "other producers)")
            failure = Failure(code, f"sent batch {batch_id} under an ID the run had accepted before",
                              "a producer numbers its batches itself: this one is not ours or is broken",
                              batch_id=batch_id, fault=bad.fault)
        self.out.send(p.identity, Reject(said, code, answers={"type": "batch", "batch_id": batch_id}))
        p.failure = failure
        return f"batch {batch_id} refused ({bad.fault})"

    def stale(self, a: Arrival, named: Session | None, reason: str, now: float) -> None:
        m = a.batch
        if isinstance(named, ProducerSession):
            named.stale += 1
        producer = clip(m.producer, 64)  # a key of the rate limit: the sender chose it
        ok, suppressed = self.replies.allow(f"stale:{producer}", now)
        if ok:
            log.warning("broker.batch_stale", batch_id=clip(m.batch_id, 64), producer=producer,
                        peer_instance=named.instance if named is not None else None, lease=m.lease, epoch=m.epoch,
                        reason=clip(reason, MAX_REASON), **connection_fields(a.conn), suppressed=suppressed)


def from_own_connection(p: ProducerSession, conn: dict) -> bool:
    """Whether a data-in message came on `p`'s own connection (ZMTP metadata, and Curve key if any)."""
    return conn.get("peer") == p.id and (p.curve_key is None or conn.get("key") == p.curve_key)
