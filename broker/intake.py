"""Batches arriving on data in (PROTOCOL.md 4.4): validate, accept or drop, enqueue.

A batch is accepted only from a live producer, for a lease it still holds, carrying only
samples of that lease not yet received. Anything else is dropped as stale: that is how a
producer declared lost cannot put a sample in twice. Accepted batches keep their zmq
frames as they came; dispatch relays those very frames.
"""

from __future__ import annotations

import time

from dflash.protocol import codec
from dflash.protocol.errors import ProtocolError
from dflash.protocol.logs import get_logger
from dflash.protocol.messages import DATA

from .control import finish_lease
from .dispatch import QueuedBatch
from .leases import StaleBatch
from .replies import MAX_REASON, clip, log_bad

log = get_logger()


def sender(frames: list) -> str:
    """Who sent this data message, for log lines: its `producer` field if the header
    parses, else the TCP peer address ZeroMQ reports for the frame."""
    try:
        prod = codec.unpack_header(frames[0]).get("producer")
        if isinstance(prod, str) and prod:
            return prod[:64]
    except (ProtocolError, IndexError):
        pass
    try:
        return f"addr:{frames[0].get('Peer-Address')}"
    except Exception:  # not a zmq.Frame, or the transport gives no address
        return "addr:unknown"


def handle(b, frames: list) -> None:
    """One message from data in. Never raises on bad input."""
    try:
        msg = codec.decode(frames, allowed=DATA, run=b.run_id, views=False)  # relayed, never read
        payload = msg.payload_bytes()
        if payload > b.cfg.max_message_bytes:
            return too_large(b, msg.header, payload)
        layers = b.facts.get("layer_ids")
        if layers is not None and msg.header["layer_ids"] != layers:
            raise ProtocolError(f"layer_ids {msg.header['layer_ids']} are not this run's {layers}")
    except ProtocolError as e:
        return log_bad(b, "data_in", sender(frames), e.reason)
    h = msg.header
    p = b.peers.by_id.get(h["producer"])
    try:
        if p is None or p.role != "producer":
            raise StaleBatch(f"producer {h['producer']!r} has no live session")
        if h["batch_id"] in b.batch_ids:
            raise StaleBatch(f"batch_id {h['batch_id']!r} is already queued or in flight")
        lease = b.leases.arrived(h["lease"], p.id, h["epoch"], h["samples"])
    except StaleBatch as e:
        return stale(b, h, str(e))
    p.last_seen = time.monotonic()  # data counts as a sign of life too
    # The header counts too: unknown fields are allowed, so a header may be up to 1 MiB
    # for a few bytes of tensors, and the queue's byte bound must see what it holds.
    qb = QueuedBatch(h["batch_id"], p.id, h["lease"], h["epoch"], list(h["samples"]), int(sum(h["seq_lens"])),
                     payload + len(frames[0]), frames)
    b.queue.push(qb)
    b.batch_ids.add(qb.batch_id)
    b.ledger.produced(qb)
    now = time.monotonic()
    p.batches_in += 1
    p.bytes_in += qb.nbytes
    p.samples_in += len(qb.samples)
    p.rate_in.add(1, now)
    p.rate_tokens.add(qb.tokens, now)
    b.rate_in.add(1, now)
    finish_lease(b, lease)


def too_large(b, h: dict, payload: int) -> None:
    """A batch over --max-message-bytes: dropped, logged (broker.batch_too_large) and its
    producer, if it has a live session, told by `reject {code: too_large}` naming the batch:
    it would go on making batches the broker drops, holding their leases."""
    limit = b.cfg.max_message_bytes
    producer = clip(h.get("producer"), 64)
    ok, suppressed = b.log_limit.allow(f"too_large:{producer}")
    if ok:
        log.warning("broker.batch_too_large", producer=producer, batch_id=clip(h.get("batch_id"), 64),
                    bytes=payload, limit=limit, suppressed=suppressed)
    p = b.peers.by_id.get(h.get("producer")) if isinstance(h.get("producer"), str) else None
    if p is not None and b.reply_limit.allow(p.identity.hex())[0]:
        b.send(p.identity, "reject", code="too_large",
               reason=f"batch {clip(h.get('batch_id'), 64)} is {payload} tensor bytes, over this broker's "
                      f"--max-message-bytes {limit}: dropped; lower --token-budget or --max-batch-size, or raise "
                      "the broker's --max-message-bytes",
               answers={"type": "batch", "batch_id": clip(h.get("batch_id"), 64)})


def stale(b, h: dict, reason: str) -> None:
    p = b.peers.by_id.get(h["producer"])
    if p is not None:
        p.stale += 1
    producer = clip(h["producer"], 64)  # a key of the rate limit: the sender chose it
    ok, suppressed = b.log_limit.allow(f"stale:{producer}")
    if ok:
        log.warning("broker.batch_stale", batch_id=clip(h["batch_id"], 64), producer=producer,
                    lease=h["lease"], epoch=h["epoch"], reason=clip(reason, MAX_REASON), suppressed=suppressed)
