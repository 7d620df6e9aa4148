"""Batches arriving on data in (PROTOCOL.md 4.4): validate, accept or drop, enqueue.

A batch is accepted only from a live producer, for a lease it still holds, carrying only
samples of that lease not yet received. Anything else is dropped as stale: that is how a
producer declared lost cannot put a sample in twice. Accepted batches keep their zmq
frames as they came; dispatch relays those very frames.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash.protocol.messages import Reject
from dflash.runtime.logs import get_logger

from .control import finish_lease
from .dispatch import QueuedBatch
from .inbound import Batch
from .leases import StaleBatch
from .replies import MAX_REASON, clip, log_bad

if TYPE_CHECKING:  # the core calls these with itself; imported for the annotations only
    from .core import BrokerCore

log = get_logger()


def accept(core: BrokerCore, m: Batch, now: float) -> None:
    """One batch the codec passed (server.py decodes it). Never raises on bad input."""
    if m.payload_bytes > core.cfg.max_message_bytes:
        return too_large(core, m)
    layers = core.facts.get("layer_ids")
    if layers is not None and m.layer_ids != layers:
        return log_bad(core, "data_in", m.producer[:64] or "addr:unknown",
                       f"layer_ids {m.layer_ids} are not this run's {layers}")
    p = core.peers.by_id.get(m.producer)
    try:
        if p is None or p.role != "producer":
            raise StaleBatch(f"producer {m.producer!r} has no live session")
        if m.batch_id in core.batch_ids:
            raise StaleBatch(f"batch_id {m.batch_id!r} is already queued or in flight")
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


def stale(core: BrokerCore, m: Batch, reason: str) -> None:
    p = core.peers.by_id.get(m.producer)
    if p is not None:
        p.stale += 1
    producer = clip(m.producer, 64)  # a key of the rate limit: the sender chose it
    ok, suppressed = core.log_limit.allow(f"stale:{producer}")
    if ok:
        log.warning("broker.batch_stale", batch_id=clip(m.batch_id, 64), producer=producer,
                    lease=m.lease, epoch=m.epoch, reason=clip(reason, MAX_REASON), suppressed=suppressed)
