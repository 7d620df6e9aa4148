"""What the broker does with each control message (PROTOCOL.md 4), and with peers that go.

`handle` validates in the order PROTOCOL.md 3 gives, then routes by type. Every refusal
is logged with the sender (peer ID, else ROUTER identity in hex) and answered with
`reject`, both rate-limited so a flood cannot turn into a log or send storm.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from dflash.protocol.messages import PROTOCOL_VERSION, Grant, StatusReply
from dflash.runtime.logs import get_logger

from . import handshake, quarantine, runinfo
from .replies import MAX_REASON, bad_message, clip, refuse
from .config import CONTROL_MAX_BYTES, MAX_CREDIT
from .inbound import CONTROL, Ack, Bye, Commit, Credit, Done, Failed, Heartbeat, Hello, LeaseAsk, LineageStart
from .leases import Lease
from .lineage import DEFAULT, MAX_LINEAGE, TrainedBatch
from .peers import Peer
from .phase import JobLost, Phase
from .status import build_status, sanitize_stats

if TYPE_CHECKING:  # the core calls these with itself; imported for the annotations only
    from .core import BrokerCore

log = get_logger()

ROLE_TYPES = {"producer": {"lease", "done"}, "consumer": {"credit", "ack", "commit", "lineage"}}
ROLE_ONLY = ROLE_TYPES["producer"] | ROLE_TYPES["consumer"]  # messages one role alone may send
RETRY_MS = 500  # "nothing to lease now, ask again in" (grant.retry_ms)


def handle(core: BrokerCore, identity: bytes, h: dict | None, error: str | None, key: str | None, now: float) -> None:
    """One control message from ROUTER `identity`, its header parsed by the server (`h`
    None when it did not parse; `error` when the codec refused it). Never raises on bad input."""
    peer = core.peers.by_identity.get(identity)
    who = peer.id if peer else identity.hex()
    if h is None or h.get("type") != "status":
        core.peer_messages += 1  # someone tried to take part (a run nobody tried is empty: cli.py)
    if peer is not None:
        peer.last_seen = now  # any message counts as a heartbeat
    if h is None:
        return bad_message(core, identity, who, error or "empty message")
    if h.get("v") != PROTOCOL_VERSION:
        return refuse(core, identity, "version", f"protocol version {h.get('v')!r} is not supported: "
                      f"this broker speaks version {PROTOCOL_VERSION}; upgrade or downgrade dflash", h)
    if "run" in h and h["run"] != core.run_id:
        return refuse(core, identity, "run_mismatch", f"run {h['run']!r} is not the run this broker serves "
                      f"({core.run_id}); that run is over or served elsewhere: leave out --run-id to join this one", h)
    if error is not None:
        return bad_message(core, identity, who, error, h)
    t = h["type"]
    if t == "status":
        return core.send(identity, StatusReply(build_status(core)))
    if t == "hello":
        return handshake.hello(core, identity, Hello.from_header(h), key=key)
    if peer is None:
        return refuse(core, identity, "unknown_peer", "this connection has no live session (never said hello, "
                      "was declared lost, or its connection was closed and reopened: ZeroMQ closes a connection "
                      f"that sends a frame over the control limit of {CONTROL_MAX_BYTES} bytes): say hello "
                      "again to rejoin", h)
    if t in ROLE_ONLY and t not in ROLE_TYPES[peer.role]:
        return bad_message(core, identity, who, f"{t!r} is not accepted from a {peer.role}", h)
    msg = CONTROL[t].from_header(h)
    HANDLERS[type(msg)](core, peer, msg)


# ---------------------------------------------------------------- producers


def on_lease(core: BrokerCore, p: Peer, m: LeaseAsk) -> None:
    epoch_before = core.leases.epoch
    size = min(m.want, core.cfg.lease_size, core.leases.share(len(core.peers.live("producer"))))
    lease = None if core.end is not None else core.leases.grant(p.id, size)
    if lease is None:
        # Elastic consumers may restart the training from a checkpoint, sending samples
        # already made back to the pool (on_lineage): producers stay until end of stream.
        end = core.end is not None or (core.leases.finished() and core.lighthouse is None)
        return core.send(p.identity, Grant(0, core.leases.epoch, [], end, retry_ms=RETRY_MS))
    if core.leases.epoch != epoch_before or lease.id == 1:
        core.ledger.epoch_started(core.leases.epoch, core.cfg.seed, core.leases.n_samples)
        log.info("broker.epoch_started", epoch=core.leases.epoch, epochs=core.cfg.epochs,
                 n_samples=core.leases.n_samples)
    core.ledger.leased(lease.id, lease.epoch, p.id, lease.samples)
    log.info("broker.lease_granted", lease=lease.id, peer=p.id, epoch=lease.epoch, n=len(lease.samples),
             want=m.want, pending=core.leases.pending())
    core.send(p.identity, Grant(lease.id, lease.epoch, lease.samples, False))


def on_done(core: BrokerCore, p: Peer, m: Done) -> None:
    lease = core.leases.open.get(m.lease)
    if lease is None or lease.producer != p.id:
        # Already complete (every sample arrived before `done`), or not this producer's.
        log.debug("broker.done_ignored", peer=p.id, lease=m.lease)
        return
    skipped = core.leases.skip(lease, m.skipped)
    if skipped:
        core.ledger.skipped(lease.epoch, skipped)
        log.info("broker.samples_skipped", peer=p.id, lease=lease.id, n=len(skipped),
                 first=[list(x) for x in skipped[:8]])
    lease.done_at = time.monotonic()
    finish_lease(core, lease)


def finish_lease(core: BrokerCore, lease: Lease) -> None:
    if core.leases.close_if_complete(lease):
        core.ledger.lease_closed(lease.id, "done")
        log.info("broker.lease_done", lease=lease.id, peer=lease.producer, epoch=lease.epoch,
                 n=len(lease.samples), skipped=lease.skipped)


def lease_incomplete(core: BrokerCore, lease: Lease) -> None:
    """`done` came long ago but samples never arrived: make them again elsewhere."""
    back = core.leases.give_back(lease)
    core.ledger.released(lease.epoch, back)
    core.ledger.lease_closed(lease.id, "incomplete")
    log.warning("broker.lease_incomplete", lease=lease.id, peer=lease.producer, missing=len(back),
                samples=back[:16], waited_s=round(core.cfg.timeout_s, 1))


# ---------------------------------------------------------------- consumers


def on_credit(core: BrokerCore, p: Peer, m: Credit) -> None:
    if m.credit < 0:
        return bad_message(core, p.identity, p.id, f"credit {m.credit} is negative", m.raw)
    p.credit = min(MAX_CREDIT, p.credit + m.credit)


def on_ack(core: BrokerCore, p: Peer, m: Ack) -> None:
    lineage, step = lineage_of(m.lineage), m.step
    kept = core.lineages.refused(lineage, step)
    if kept is not None:
        return superseded(core, p, "ack", lineage, step, kept)
    unknown, trained = [], []
    for bid in m.batch_ids:
        qb = p.in_flight.pop(bid, None) if isinstance(bid, str) else None
        if qb is None:
            unknown.append(bid)
            continue
        core.batch_ids.discard(bid)
        core.queue.release(qb)
        qb.frames = []  # trained: never sent again (a rewind makes its samples anew)
        core.ledger.trained(qb, p.id, step)
        core.trained[bid] = TrainedBatch(qb, lineage, step, p.id)
        core.rate_samples.add(len(qb.samples))  # the ETA's pace
        p.acked += 1
        trained.append(qb)
    now = time.monotonic()
    if trained:
        if p.acked > len(trained):  # a gap between two acks: how slow this consumer's steps are
            p.slowest_ack_gap = max(p.slowest_ack_gap, now - p.progress_at)
        p.progress_at = now
    if unknown and core.log_limit.allow(f"ack:{p.id}")[0]:
        log.warning("broker.ack_unknown", peer=p.id, step=step, batch_ids=[str(x)[:64] for x in unknown[:16]],
                    n=len(unknown))
    last = core.ledger.last_commit
    if trained and last is not None:
        late = [core.trained[x.batch_id] for x in trained]
        if core.lineages.holds(core.lineages.last_commit_lineage or DEFAULT, last[0], late[0]):
            commit_late(core, p, step, late, last)


def lineage_of(lin) -> str:
    """The lineage an ack or commit names ("" when it names none, or not as a string)."""
    return lin[:MAX_LINEAGE] if isinstance(lin, str) else DEFAULT


def commit_late(core: BrokerCore, p: Peer, step: int, late: list[TrainedBatch], last: tuple[int, str]) -> None:
    """An ack that comes after the commit whose checkpoint holds it (PROTOCOL.md 4.5: each
    rank acks on its own connection): committed now, not at the next commit (a crash in
    between would train them twice)."""
    batches = [t.batch for t in late]
    n = core.ledger.committed_late(batches)
    for x in batches:
        core.trained.pop(x.batch_id, None)
    log.info("broker.ack_committed", peer=p.id, step=step, commit_step=last[0], checkpoint=last[1],
             batch_ids=[x.batch_id for x in batches[:16]], samples=n, committed=core.ledger.counts["committed"])


def on_commit(core: BrokerCore, p: Peer, m: Commit) -> None:
    """Commit exactly the trained batches the checkpoint's weights hold (lineage.py)."""
    lineage, step = lineage_of(m.lineage), m.step
    kept = core.lineages.refused(lineage, step)
    if kept is not None:
        return superseded(core, p, "commit", lineage, step, kept)
    held = [t for t in core.trained.values() if core.lineages.holds(lineage, step, t)]
    n = core.ledger.committed(step, m.checkpoint, p.id, [t.batch for t in held])
    for t in held:
        del core.trained[t.batch.batch_id]
    core.lineages.last_commit_lineage = lineage
    log.info("broker.commit", peer=p.id, step=step, checkpoint=m.checkpoint, samples=n,
             committed=core.ledger.counts["committed"], lineage=lineage or None, trained_left=len(core.trained))


def on_lineage(core: BrokerCore, p: Peer, m: LineageStart) -> None:
    """A consumer starts a new lineage (fresh, or from a checkpoint): what was trained that
    its weights do not hold goes back to the lease pool, to be made and trained again."""
    lineage, parent, step = m.lineage[:MAX_LINEAGE], m.parent, m.step
    parent = parent[:MAX_LINEAGE] if isinstance(parent, str) and parent else None
    if core.lineages.known(lineage):
        log.debug("broker.lineage_again", peer=p.id, lineage=lineage)
        return
    last = core.ledger.last_commit
    if last is not None:  # the newest commit must be in the new weights, or its samples are lost
        lin = core.lineages.last_commit_lineage or DEFAULT
        if parent is None or core.lineages.caps(parent, step).get(lin, -1) < last[0]:
            reason = (f"this consumer started from {m.checkpoint or 'no checkpoint'} (step {step}), but the "
                      f"run has committed step {last[0]} ({last[1]}) since: its weights would miss those samples; "
                      "start it again (it then starts from the newest commit)")
            log.warning("broker.lineage_stale", peer=p.id, lineage=lineage, parent=parent, step=step,
                        checkpoint=m.checkpoint, commit_step=last[0], commit_checkpoint=last[1])
            refuse(core, p.identity, "stale_checkpoint", reason, m.raw)
            return drop(core, p, "lost", "started from a checkpoint older than the newest commit")
    core.lineages.start(lineage, parent, step)
    rewound = []
    for t in list(core.trained.values()):
        if t.lineage != lineage and not (parent is not None and core.lineages.holds(parent, step, t)):
            rewound.append(t)
            del core.trained[t.batch.batch_id]
            core.ledger.rewound(t.batch)
            core.leases.rewind(t.batch.epoch, t.batch.samples)
    n = sum(len(t.batch.samples) for t in rewound)
    log.info("broker.lineage_started", peer=p.id, lineage=lineage, parent=parent, step=step,
             checkpoint=m.checkpoint, rewound_samples=n)
    if rewound:
        log.warning("broker.samples_rewound", peer=p.id, lineage=lineage, step=step, samples=n,
                    batch_ids=[t.batch.batch_id for t in rewound[:16]], n_batches=len(rewound),
                    lineages=sorted({t.lineage or DEFAULT for t in rewound})[:8],
                    steps=[min(t.step for t in rewound), max(t.step for t in rewound)])
    if core.job_lost is not None and not core.trained:  # what only the dead weights held is being made again
        log.info("broker.job_resumed", peer=p.id, lineage=lineage, step=step, rewound_samples=n)
        core.job_lost = None
        if core.phase is Phase.JOB_LOST:
            core.phase = Phase.RUNNING


def superseded(core: BrokerCore, p: Peer, what: str, lineage: str, step: int, kept: int) -> None:
    """An ack or commit from weights a newer lineage left behind: refused, and the
    consumer's session ends (its batches in flight go back to the queue)."""
    reason = (f"{what} of step {step} from lineage {lineage or '(none)'}: a consumer has restarted the training "
              f"from a checkpoint since, keeping this lineage's steps up to {kept} only; these weights are no "
              "longer the run's: start this consumer again (it joins the running ones)")
    log.warning("broker.lineage_superseded", peer=p.id, what=what, lineage=lineage or None, step=step, kept_step=kept,
                head=core.lineages.head)
    refuse(core, p.identity, "lineage_superseded", reason)
    drop(core, p, "lost", f"{what} from a superseded lineage")


def last_commit(core: BrokerCore) -> dict | None:
    """The run's newest commit, for the broker's heartbeat (PROTOCOL.md 4.2)."""
    last = core.ledger.last_commit
    if last is None:
        return None
    return {"run": core.run_id, "step": last[0], "checkpoint": last[1], "lineage": core.lineages.last_commit_lineage}


# ---------------------------------------------------------------- everyone


def on_heartbeat(core: BrokerCore, p: Peer, m: Heartbeat) -> None:
    p.stats, p.stats_at = sanitize_stats(m.stats), time.time()


def on_bye(core: BrokerCore, p: Peer, m: Bye) -> None:
    drop(core, p, "left", m.reason[:200])


def on_failed(core: BrokerCore, p: Peer, m: Failed) -> None:
    """A peer stops on an error and says why before its `bye` (PROTOCOL.md 4.2): kept for the
    status map and the diagnosis; a consumer's `bad_batch` counts against that batch, which
    is quarantined once --quarantine-after consumers have failed on it (quarantine.py)."""
    p.failure = {"code": clip(m.code, 64), "reason": clip(m.reason, MAX_REASON), "hint": clip(m.hint, MAX_REASON),
                 "source": clip(m.source, 256), "batch_id": clip(m.batch_id, 64), "fault": clip(m.fault, 64)}
    batch = {}
    if p.role == "consumer" and m.code == "bad_batch" and isinstance(m.batch_id, str):
        fault = m.fault if isinstance(m.fault, str) and m.fault else "unknown"
        batch = quarantine.failed_on(core, p, m.batch_id, fault, m.reason)
    if core.log_limit.allow(f"failed:{p.id}")[0]:
        log.warning("broker.peer_failed", **p.describe(), **p.failure, **batch)


HANDLERS = {LeaseAsk: on_lease, Done: on_done, Credit: on_credit, Ack: on_ack,
            Commit: on_commit, LineageStart: on_lineage, Heartbeat: on_heartbeat, Bye: on_bye, Failed: on_failed}


def drop(core: BrokerCore, p: Peer, state: str, reason: str) -> None:
    """End a session (state 'lost' or 'left'): requeue what it held, log what that was."""
    silent_s = round(time.monotonic() - p.last_seen, 3)
    if p.role == "consumer":
        back = list(p.in_flight.values())
        p.in_flight.clear()
        for qb in back:
            core.ledger.requeued(qb)
        core.queue.requeue(back)  # returned batches are the oldest: they go first
        core.close_pipes(p)
        held = {"in_flight": len(back), "batch_ids": [x.batch_id for x in back[:16]], "credit": p.credit,
                "delivered": p.delivered, "acked": p.acked, "rank": p.rank}
    else:
        returned = core.leases.release(p.id)
        for lease, back in returned:
            core.ledger.released(lease.epoch, back)
            core.ledger.lease_closed(lease.id, "returned")
        held = {"leases": [le.id for le, _ in returned], "samples_returned": sum(len(x) for _, x in returned),
                "batches_in": p.batches_in}
    p.held = held
    core.peers.remove(p, state, reason)
    if p.role == "consumer":
        check_job(core, p, state, reason)
    core.ledger.peer_gone(p.id, state, reason)
    fields = dict(**p.describe(), reason=reason, silent_s=silent_s, held=held, last_stats=p.stats)
    if state == "lost":
        log.warning("broker.peer_lost", **fields)
    else:
        log.info("broker.peer_left", **fields)


def check_acks(core: BrokerCore, now: float) -> None:
    """A consumer that holds delivered batches and acks none within its deadline (it
    heartbeats, so it is not silent: hung in a step, or a client that never acks) would
    hold them forever and block end of stream: declared lost, its batches requeued."""
    for c in core.peers.live("consumer"):
        if not c.in_flight:
            continue
        deadline = core.cfg.ack_deadline(c.slowest_ack_gap)
        waited = now - c.progress_at
        if waited > deadline:
            log.warning("broker.ack_overdue", peer=c.id, peer_instance=c.instance, in_flight=len(c.in_flight),
                        batch_ids=list(c.in_flight)[:16], waited_s=round(waited, 1), deadline_s=round(deadline, 1),
                        acked=c.acked, last_step=c.stats.get("step"), state=c.stats.get("state"))
            drop(core, c, "lost", f"no ack for {waited:.1f}s while holding {len(c.in_flight)} delivered batches "
                 f"(ack deadline {deadline:.0f}s, --ack-timeout-s)")


def check_job(core: BrokerCore, p: Peer, state: str, reason: str) -> None:
    """The last consumer is gone before end of stream while samples are trained and not
    committed: those lived only in the weights that went with the job. This run cannot
    make them again (their batches are gone once acked), so consumers joining it now would
    skip them; they are refused (`job_lost`) and the run must be resumed, which makes again
    everything not committed. After a clean stop (everything committed) consumers may join
    and start from the newest commit (handshake.welcome)."""
    trained = core.ledger.counts["trained"]
    if core.phase is Phase.RUNNING and core.job_lost is None and trained > 0 and not core.peers.live("consumer"):
        core.job_lost = JobLost(p.id, state, reason, trained)
        core.phase = Phase.JOB_LOST
        log.warning("broker.job_lost", peer=p.id, state=state, reason=reason, trained=trained,
                    last_commit=list(core.ledger.last_commit) if core.ledger.last_commit else None,
                    hint=f"restart with dflash-broker --resume {core.run_id}")


def check_end_of_stream(core: BrokerCore) -> None:
    """PROTOCOL.md 4.6: all produced or skipped, queue empty, everything acked -> stop."""
    if core.phase in (Phase.RUNNING, Phase.JOB_LOST):
        consumers = core.peers.live("consumer")
        if core.leases.finished() and not core.queue and not any(c.in_flight for c in consumers):
            log.info("broker.end_of_stream", consumers=[c.id for c in consumers],
                     producers=[p.id for p in core.peers.live("producer")], batches=core.rate_in.total,
                     samples=dict(core.ledger.counts), bad_batches=core.poison.as_dict())
            core.stop_all("end_of_stream")
            core.phase = Phase.ENDING
    elif core.phase is Phase.ENDING and not any(pid in core.peers.by_id for pid in core.end.told):
        core.ledger.flush()
        outcome, why = runinfo.end_of_stream_outcome(core)  # `nothing_to_train` when it trained nothing
        log.info("broker.stop", reason="end_of_stream", outcome=outcome)
        core.finish(outcome, why)
