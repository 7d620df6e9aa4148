"""What the broker does with each control message (PROTOCOL.md 4), and with peers that go.

`handle` validates in the order PROTOCOL.md 3 gives, then routes by type. Every refusal
is logged with the sender (peer ID, else ROUTER identity in hex) and answered with
`reject`, both rate-limited so a flood cannot turn into a log or send storm.
"""

from __future__ import annotations

import time

from dflash.protocol import codec, curve
from dflash.protocol.errors import ProtocolError
from dflash.protocol.logs import get_logger
from dflash.protocol.messages import CONTROL_TO_BROKER, PROTOCOL_VERSION

from . import handshake, runinfo
from .replies import bad_message, refuse
from .config import CONTROL_MAX_BYTES, MAX_CREDIT
from .leases import Lease
from .peers import Peer
from .status import build_status, sanitize_stats

log = get_logger()

ROLE_TYPES = {"producer": {"lease", "done"}, "consumer": {"credit", "ack", "commit"}}
ROLE_ONLY = ROLE_TYPES["producer"] | ROLE_TYPES["consumer"]  # messages one role alone may send
RETRY_MS = 500  # "nothing to lease now, ask again in" (grant.retry_ms)


def handle(b, identity: bytes, frames: list) -> None:
    """One control message from ROUTER `identity`. Never raises on bad input."""
    peer = b.peers.by_identity.get(identity)
    who = peer.id if peer else identity.hex()
    if peer is not None:
        peer.last_seen = time.monotonic()  # any message counts as a heartbeat
    try:
        if not frames:
            raise ProtocolError("empty message")
        h = codec.unpack_header(frames[0])
    except ProtocolError as e:
        return bad_message(b, identity, who, e.reason)
    if h.get("v") != PROTOCOL_VERSION:
        return refuse(b, identity, "version", f"protocol version {h.get('v')!r} is not supported: "
                      f"this broker speaks version {PROTOCOL_VERSION}; upgrade or downgrade dflash", h)
    if "run" in h and h["run"] != b.run_id:
        return refuse(b, identity, "run_mismatch", f"run {h['run']!r} is not the run this broker serves "
                      f"({b.run_id}); that run is over or served elsewhere: leave out --run-id to join this one", h)
    try:
        msg = codec.decode(frames, allowed=CONTROL_TO_BROKER, run=b.run_id, peer=who, parsed=h)
    except ProtocolError as e:
        return bad_message(b, identity, who, e.reason, h)
    t, h = msg.type, msg.header
    if t == "status":
        return b.send(identity, "status_reply", status=build_status(b))
    if t == "hello":
        return handshake.hello(b, identity, h, key=curve.key_name(frames[0]))
    if peer is None:
        return refuse(b, identity, "unknown_peer", "this connection has no live session (never said hello, "
                      "was declared lost, or its connection was closed and reopened: ZeroMQ closes a connection "
                      f"that sends a frame over the control limit of {CONTROL_MAX_BYTES} bytes): say hello "
                      "again to rejoin", h)
    if t in ROLE_ONLY and t not in ROLE_TYPES[peer.role]:
        return bad_message(b, identity, who, f"{t!r} is not accepted from a {peer.role}", h)
    HANDLERS[t](b, peer, h)


# ---------------------------------------------------------------- producers


def on_lease(b, p: Peer, h: dict) -> None:
    epoch_before = b.leases.epoch
    lease = None if b.stopping is not None else b.leases.grant(p.id, min(h["want"], b.cfg.lease_size))
    if lease is None:
        end = b.stopping is not None or b.leases.finished()
        return b.send(p.identity, "grant", lease=0, epoch=b.leases.epoch, samples=[], end=end, retry_ms=RETRY_MS)
    if b.leases.epoch != epoch_before or lease.id == 1:
        b.ledger.epoch_started(b.leases.epoch, b.cfg.seed, b.leases.n_samples)
        log.info("broker.epoch_started", epoch=b.leases.epoch, epochs=b.cfg.epochs, n_samples=b.leases.n_samples)
    b.ledger.leased(lease.id, lease.epoch, p.id, lease.samples)
    log.info("broker.lease_granted", lease=lease.id, peer=p.id, epoch=lease.epoch, n=len(lease.samples),
             want=h["want"], pending=b.leases.pending())
    b.send(p.identity, "grant", lease=lease.id, epoch=lease.epoch, samples=lease.samples, end=False)


def on_done(b, p: Peer, h: dict) -> None:
    lease = b.leases.open.get(h["lease"])
    if lease is None or lease.producer != p.id:
        # Already complete (every sample arrived before `done`), or not this producer's.
        log.debug("broker.done_ignored", peer=p.id, lease=h["lease"])
        return
    skipped = b.leases.skip(lease, h["skipped"])
    if skipped:
        b.ledger.skipped(lease.epoch, skipped)
        log.info("broker.samples_skipped", peer=p.id, lease=lease.id, n=len(skipped),
                 first=[list(x) for x in skipped[:8]])
    lease.done_at = time.monotonic()
    finish_lease(b, lease)


def finish_lease(b, lease: Lease) -> None:
    if b.leases.close_if_complete(lease):
        b.ledger.lease_closed(lease.id, "done")
        log.info("broker.lease_done", lease=lease.id, peer=lease.producer, epoch=lease.epoch,
                 n=len(lease.samples), skipped=lease.skipped)


def lease_incomplete(b, lease: Lease) -> None:
    """`done` came long ago but samples never arrived: make them again elsewhere."""
    back = b.leases.give_back(lease)
    b.ledger.released(lease.epoch, back)
    b.ledger.lease_closed(lease.id, "incomplete")
    log.warning("broker.lease_incomplete", lease=lease.id, peer=lease.producer, missing=len(back),
                samples=back[:16], waited_s=round(b.cfg.timeout_s, 1))


# ---------------------------------------------------------------- consumers


def on_credit(b, p: Peer, h: dict) -> None:
    if h["credit"] < 0:
        return bad_message(b, p.identity, p.id, f"credit {h['credit']} is negative", h)
    p.credit = min(MAX_CREDIT, p.credit + h["credit"])


def on_ack(b, p: Peer, h: dict) -> None:
    unknown, trained = [], []
    for bid in h["batch_ids"]:
        qb = p.in_flight.pop(bid, None) if isinstance(bid, str) else None
        if qb is None:
            unknown.append(bid)
            continue
        b.batch_ids.discard(bid)
        b.queue.release(qb)
        b.ledger.trained(qb, p.id, h["step"])
        b.rate_samples.add(len(qb.samples))  # the ETA's pace
        p.acked += 1
        trained.append(qb)
    if unknown and b.log_limit.allow(f"ack:{p.id}")[0]:
        log.warning("broker.ack_unknown", peer=p.id, step=h["step"], batch_ids=[str(x)[:64] for x in unknown[:16]],
                    n=len(unknown))
    last = b.ledger.last_commit
    if trained and last is not None and h["step"] <= last[0]:
        commit_late(b, p, h["step"], trained, last)


def commit_late(b, p: Peer, step: int, batches: list, last: tuple[int, str]) -> None:
    """An ack that comes after the commit of its step (PROTOCOL.md 4.5: each rank acks on
    its own connection): the committed checkpoint holds these samples, so they are
    committed now, not at the next commit (a crash in between would train them twice)."""
    n = b.ledger.committed_late(batches)
    log.info("broker.ack_committed", peer=p.id, step=step, commit_step=last[0], checkpoint=last[1],
             batch_ids=[x.batch_id for x in batches[:16]], samples=n, committed=b.ledger.counts["committed"])


def on_commit(b, p: Peer, h: dict) -> None:
    n = b.ledger.committed(h["step"], h["checkpoint"], p.id)
    log.info("broker.commit", peer=p.id, step=h["step"], checkpoint=h["checkpoint"], samples=n,
             committed=b.ledger.counts["committed"])


# ---------------------------------------------------------------- everyone


def on_heartbeat(b, p: Peer, h: dict) -> None:
    p.stats, p.stats_at = sanitize_stats(h["stats"]), time.time()


def on_bye(b, p: Peer, h: dict) -> None:
    drop(b, p, "left", h["reason"][:200])


HANDLERS = {"lease": on_lease, "done": on_done, "credit": on_credit, "ack": on_ack,
            "commit": on_commit, "heartbeat": on_heartbeat, "bye": on_bye}


def drop(b, p: Peer, state: str, reason: str) -> None:
    """End a session (state 'lost' or 'left'): requeue what it held, log what that was."""
    silent_s = round(time.monotonic() - p.last_seen, 3)
    if p.role == "consumer":
        back = list(p.in_flight.values())
        p.in_flight.clear()
        for qb in back:
            b.ledger.requeued(qb)
        b.queue.requeue(back)  # returned batches are the oldest: they go first
        p.close_pipes()
        held = {"in_flight": len(back), "batch_ids": [x.batch_id for x in back[:16]], "credit": p.credit,
                "delivered": p.delivered, "acked": p.acked, "rank": p.rank}
    else:
        returned = b.leases.release(p.id)
        for lease, back in returned:
            b.ledger.released(lease.epoch, back)
            b.ledger.lease_closed(lease.id, "returned")
        held = {"leases": [le.id for le, _ in returned], "samples_returned": sum(len(x) for _, x in returned),
                "batches_in": p.batches_in}
    p.held = held
    b.peers.remove(p, state, reason)
    if p.role == "consumer":
        check_job(b, p, state, reason)
    b.ledger.peer_gone(p.id, state, reason)
    fields = dict(**p.describe(), reason=reason, silent_s=silent_s, held=held, last_stats=p.stats)
    if state == "lost":
        log.warning("broker.peer_lost", **fields)
    else:
        log.info("broker.peer_left", **fields)


def check_job(b, p: Peer, state: str, reason: str) -> None:
    """The last consumer is gone before end of stream while samples are trained and not
    committed: those lived only in the weights that went with the job. This run cannot
    make them again (their batches are gone once acked), so consumers joining it now would
    skip them; they are refused (`job_lost`) and the run must be resumed, which makes again
    everything not committed. After a clean stop (everything committed) consumers may join
    and start from the newest commit (handshake.welcome)."""
    trained = b.ledger.counts["trained"]
    if b.stopping is None and b.job_lost is None and trained > 0 and not b.peers.live("consumer"):
        b.job_lost = {"peer": p.id, "state": state, "reason": reason, "trained": trained}
        log.warning("broker.job_lost", peer=p.id, state=state, reason=reason, trained=trained,
                    last_commit=list(b.ledger.last_commit) if b.ledger.last_commit else None,
                    hint=f"restart with dflash-broker --resume {b.run_id}")


def check_end_of_stream(b) -> None:
    """PROTOCOL.md 4.6: all produced or skipped, queue empty, everything acked -> stop."""
    if b.stopping is None:
        consumers = b.peers.live("consumer")
        if b.leases.finished() and not b.queue and not any(c.in_flight for c in consumers):
            b.stopping = {p.id for p in b.peers.live()}
            log.info("broker.end_of_stream", consumers=[c.id for c in consumers],
                     producers=[p.id for p in b.peers.live("producer")], batches=b.rate_in.total,
                     samples=dict(b.ledger.counts))
            for p in b.peers.live():
                b.send(p.identity, "stop", reason="end_of_stream")
    elif not any(pid in b.peers.by_id for pid in b.stopping):
        b.ledger.flush()
        outcome, b.outcome_why = runinfo.end_of_stream_outcome(b)  # `nothing_to_train` when it trained nothing
        log.info("broker.stop", reason="end_of_stream", outcome=outcome)
        b.outcome = outcome
