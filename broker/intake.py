"""Batches arriving on data in (PROTOCOL.md 4.4): validate, accept or drop, enqueue.

A batch is accepted only from a live producer, for a lease it still holds, carrying only
samples of that lease not yet received. Anything else is dropped as stale: that is how a
producer declared lost cannot put a sample in twice. A batch that does not fit the run's
target (fit.py) is refused and counted (quarantine.py); its producer is told and its session
ends only when the batch came on that producer's own connection (its ZMTP metadata and Curve
key), since the `producer` field alone is anyone's to write. Accepted batches keep their zmq
frames as they came; dispatch relays those very frames.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash.protocol.messages import Reject
from dflash.runtime.logs import get_logger

from .control import drop, finish_lease
from .dispatch import QueuedBatch
from .fit import Misfit, misfit
from .inbound import Batch
from .leases import StaleBatch
from .peers import Peer
from .replies import MAX_REASON, clip

if TYPE_CHECKING:  # the core calls these with itself; imported for the annotations only
    from .core import BrokerCore

log = get_logger()


def accept(core: BrokerCore, m: Batch, now: float) -> None:
    """One batch the codec passed (server.py decodes it). Never raises on bad input."""
    if m.payload_bytes > core.cfg.max_message_bytes:
        return too_large(core, m)
    p = core.peers.by_id.get(m.producer)
    try:
        if p is None or p.role != "producer":
            raise StaleBatch(f"producer {m.producer!r} has no live session")
        if m.batch_id in core.batch_ids:
            raise StaleBatch(f"batch_id {m.batch_id!r} is already queued or in flight")
        bad = misfit(core.facts, m)
        if bad is not None:  # before its samples count as received: a correct copy may follow
            return rejected(core, m, p, bad)
        lease = core.leases.arrived(m.lease, p.id, m.epoch, m.samples)
    except StaleBatch as e:
        return stale(core, m, str(e))
    p.last_seen = now  # data counts as a sign of life too
    # The header counts too: unknown fields are allowed, so a header may be up to 1 MiB
    # for a few bytes of tensors, and the queue's byte bound must see what it holds.
    qb = QueuedBatch(m.batch_id, p.id, m.lease, m.epoch, list(m.samples), int(sum(m.seq_lens)),
                     m.payload_bytes + m.header_bytes, m.frames)
    core.queue.push(qb)
    core.batch_ids.add(qb.batch_id)
    core.ledger.produced(qb)
    p.batches_in += 1
    p.bytes_in += qb.nbytes
    p.samples_in += len(qb.samples)
    p.rate_in.add(1, now)
    p.rate_tokens.add(qb.tokens, now)
    core.rate_in.add(1, now)
    finish_lease(core, lease)


def too_large(core: BrokerCore, m: Batch) -> None:
    """A batch over --max-message-bytes: dropped, logged (broker.batch_too_large) and its
    producer, if it has a live session, told by `reject {code: too_large}` naming the batch:
    it would go on making batches the broker drops, holding their leases."""
    limit, payload = core.cfg.max_message_bytes, m.payload_bytes
    producer, batch_id = clip(m.producer, 64), clip(m.batch_id, 64)
    ok, suppressed = core.log_limit.allow(f"too_large:{producer}")
    if ok:
        log.warning("broker.batch_too_large", producer=producer, batch_id=batch_id,
                    bytes=payload, limit=limit, suppressed=suppressed)
    p = core.peers.by_id.get(m.producer)
    if p is not None and core.reply_limit.allow(p.identity.hex())[0]:
        core.send(p.identity, Reject(
            f"batch {batch_id} is {payload} tensor bytes, over this broker's --max-message-bytes {limit}: dropped; "
            "lower --token-budget or --max-batch-size, or raise the broker's --max-message-bytes",
            "too_large", answers={"type": "batch", "batch_id": batch_id}))


def rejected(core: BrokerCore, m: Batch, p: Peer, bad: Misfit) -> None:
    """A batch naming live producer `p` that does not fit the run: dropped, counted, logged
    (broker.batch_rejected). If it came on `p`'s own connection, `p` is told (`reject
    {code: bad_batch}`) and its session ends: its leases go back to the pool for other
    producers, as a producer that lies about its target would make every batch wrong."""
    conn = m.connection()
    own = from_own_connection(p, conn)
    core.poison.count("rejected", bad.fault, len(m.samples))
    core.ledger.rejected(m, bad.fault, bad.reason)
    batch_id = clip(m.batch_id, 64)
    ok, suppressed = core.log_limit.allow(f"rejected:{p.id}")
    if ok:
        log.warning("broker.batch_rejected", batch_id=batch_id, lease=m.lease, epoch=m.epoch, samples=len(m.samples),
                    fault=bad.fault, reason=bad.reason, **p.describe(), own_connection=own,
                    **connection_fields(conn), suppressed=suppressed)
    if not own:  # anyone may write `producer`: the named session and its lease stay as they are
        return
    core.send(p.identity, Reject(
        f"batch {batch_id} does not fit this run's target: {bad.reason}; refused, and this producer's session is "
        "ended (its leases go to other producers): check --target and --target-layers against the run's",
        "bad_batch", answers={"type": "batch", "batch_id": batch_id}))
    p.failure = {"code": "bad_batch", "reason": f"sent batch {batch_id} that does not fit the run: {bad.reason}",
                 "hint": "start it with the run's --target and --target-layers (dflash-status shows the run's facts)"}
    drop(core, p, "lost", f"batch {batch_id} does not fit the run ({bad.fault})")


def from_own_connection(p: Peer, conn: dict) -> bool:
    """Whether a data-in message came on producer `p`'s own connection: its ZMTP metadata
    names `p` and, with Curve, its key is the one `p` joined with."""
    return conn.get("peer") == p.id and (p.curve_key is None or conn.get("key") == p.curve_key)


def connection_fields(conn: dict) -> dict:
    """Log fields naming the connection a data-in message came on (inbound.connection)."""
    return {"peer_address": conn.get("address"), "connection_peer": clip(conn.get("peer"), 64),
            "connection_instance": clip(conn.get("instance"), 128), "curve_key": conn.get("key")}


def stale(core: BrokerCore, m: Batch, reason: str) -> None:
    p = core.peers.by_id.get(m.producer)
    if p is not None:
        p.stale += 1
    producer = clip(m.producer, 64)  # a key of the rate limit: the sender chose it
    ok, suppressed = core.log_limit.allow(f"stale:{producer}")
    if ok:
        log.warning("broker.batch_stale", batch_id=clip(m.batch_id, 64), producer=producer,
                    peer_instance=p.instance if p is not None else None, lease=m.lease, epoch=m.epoch,
                    reason=clip(reason, MAX_REASON), **connection_fields(m.connection()), suppressed=suppressed)
