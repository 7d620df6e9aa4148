"""The broker's state machine without sockets: `BrokerCore` and what a message means across its parts.

Each entry point takes one typed message and `now` (the server's clock, so tests inject one) and
returns the actions (actions.py) its parts decided for server.py to carry out; the core names pipes
by port and batches by ID, never holding a socket or a frame.
"""

from __future__ import annotations

import functools
from pathlib import Path

from dflash.protocol.messages import CONTROL_MAX_BYTES, Ack, Bye, Commit, Credit, DatasetFacts, Done, Failed, Heartbeat, Hello, LeaseAsk, LineageStart, Release, StatusAsk, StatusReply, Stop
from dflash.protocol.fields import Message
from dflash.runtime.logs import get_logger

from . import resume, runinfo
from .actions import Action, OpenPipes, Outbox, Relay
from .budget import Budget
from .commits import Commits, lineage_of
from .config import BrokerConfig
from .delivery import Delivery
from .facts import Facts, RunFacts
from .inbound import Arrival, BadBatch, Unreadable, connection_fields
from .intake import Intake
from .leases import MAX_OPEN_LEASES, LeasePool
from .ledger import Ledger
from .lineage import MAX_LINEAGE
from .liveness import Every, WallClock
from .peers import ConsumerSession, ProducerSession, Session
from .phase import JobLost, Lifecycle, Phase, RunEnd
from .quarantine import Poison
from .replies import Replies, clip
from .resume import Parent
from .sessions import Sessions
from .status import StatusMap
from .work import Work

log = get_logger()

# Timers run at most this often: the loop turns once per message, and checking them each time costs as much.
TICK_S = 0.005

UNKNOWN_PEER = ("this connection has no live session (never said hello, was declared lost, or its connection was "
                "closed and reopened: ZeroMQ closes a connection that sends a frame over the control limit of "
                f"{CONTROL_MAX_BYTES} bytes): say hello again to rejoin")


def entry(fn):
    """An entry point: returns the actions its parts decided (after a raise, with the next entry's)."""

    @functools.wraps(fn)
    def run(self, *args, **kwargs) -> list[Action]:
        fn(self, *args, **kwargs)
        return self.out.take()

    return run


class BrokerCore:
    def __init__(self, cfg: BrokerConfig, run_id: str, run_dir: Path, hostname: str, *, now: float, wall: float,
                 parent: Parent | None = None, pipe_threads: list[int] | None = None, streams: int = 1,
                 producer_streams: int = 1):
        """`now`/`wall`: monotonic and wall clock; `pipe_threads`: I/O threads a consumer's pipes may take."""
        self.cfg, self.run_id, self.run_dir = cfg, run_id, Path(run_dir)
        advertise = cfg.host_to_advertise(hostname)
        self.endpoints = endpoints(cfg, advertise)
        self.out = Outbox()
        self.replies = Replies(self.out, now)
        wall_clock = WallClock(wall, now)
        pool = LeasePool(cfg.epochs, cfg.seed, cfg.num_samples, parent.committed if parent else None)
        self.ledger = ledger = Ledger(self.run_dir / "ledger.sqlite")
        facts = Facts(DatasetFacts(cfg.num_samples, None) if cfg.num_samples is not None else None)
        if parent is not None:  # before any socket exists: no work goes out before this is on disk
            facts = Facts.from_dict({**facts.as_dict(), **parent.facts})
            resume.inherit(ledger, parent)
        self.life = Lifecycle()
        self.facts = RunFacts(facts, ledger, self.run_dir, pool)
        self.work = Work(cfg, pool, ledger)
        self.poison = Poison(cfg.quarantine_after)  # batches refused or quarantined (quarantine.py)
        self.delivery = Delivery(cfg.queue_bytes, ledger, self.work, self.poison, self.replies, self.out, now)
        self.intake = Intake(cfg, self.facts, self.work, self.delivery, ledger, self.poison, self.replies, self.out)
        resumed = (parent.resumed_from or {}).get("checkpoint") if parent is not None else None
        self.commits = Commits(run_id, ledger, self.work,
                               shared_disk=isinstance(resumed, str) and Path(resumed).is_absolute()
                               and Path(resumed).is_dir())
        self.sessions = Sessions(cfg, run_id, self.endpoints["data_in"], advertise=advertise, streams=streams,
                                 producer_streams=producer_streams, pipe_threads=pipe_threads or [0], facts=self.facts, ledger=ledger, life=self.life,
                                 parent=parent, replies=self.replies, out=self.out, wall=wall_clock)
        self.status = StatusMap(cfg, run_id, self.run_dir, hostname, self.endpoints, sessions=self.sessions,
                                work=self.work, delivery=self.delivery, commits=self.commits, facts=self.facts,
                                life=self.life, ledger=ledger, poison=self.poison, wall=wall_clock, now=now)
        self.last_tick = now
        self.beat, self.progress = Every(cfg.heartbeat_s, now), Every(cfg.progress_s, now)
        self.publish_status = bool(cfg.metrics_port)  # the --metrics-port endpoint wants the map
        self.budget = Budget(cfg.time_budget, now) if cfg.time_budget else None
        self.status.budget = self.budget

    # ------------------------------------------------------------ what the server reads

    @property
    def done(self) -> bool:
        """The outcome is decided: the server's loop ends."""
        return self.life.phase is Phase.DONE

    @property
    def reading(self) -> bool:
        """Whether the queue has room: a full broker stops reading data in."""
        return self.delivery.queue.has_room()

    @property
    def blocked(self) -> bool:
        """A batch waits on a consumer pipe that is not connected yet: look again soon."""
        return self.delivery.blocked

    @property
    def outcome(self) -> str | None:
        return self.life.outcome

    @property
    def outcome_why(self) -> str | None:
        return self.life.end.outcome_why if self.life.end is not None else None

    def holds(self, batch_id: str) -> bool:
        """Whether the batch of this ID is queued or in flight (the server keeps its frames)."""
        return batch_id in self.delivery.batch_ids

    def silent(self, now: float) -> bool:
        """Whether a live peer has been silent past --timeout-s (the next tick drops it)."""
        return bool(self.sessions.silent(now))

    def summary(self) -> dict:
        """What run.json records of the run when the broker ends."""
        return {"samples": dict(self.ledger.counts), "bad_batches": self.poison.as_dict(),
                "peer_messages": self.sessions.peer_messages}

    def status_map(self, now: float) -> dict:
        """The status map (status.py; `status_reply.status`)."""
        return self.status.build(now)

    # ------------------------------------------------------------ set-up

    def use_lighthouse(self, address: str | None) -> None:
        """The server started the elastic consumers' lighthouse at `address` (lighthouse.py)."""
        self.sessions.lighthouse = address

    def set_meta(self, **items) -> None:
        """What the ledger's `meta` table records of the run (its ID, schema, seed, config)."""
        self.ledger.set_meta(**items)

    def use_metric_sink(self, sink) -> None:
        """--tensorboard / --wandb: `sink(step, figures)` gets every broker.progress line."""
        self.status.metric_sink = sink

    # ------------------------------------------------------------ control messages

    @entry
    def on_unreadable(self, identity: bytes, bad: Unreadable, now: float) -> None:
        """A control message refused before any session is looked up (PROTOCOL.md 3)."""
        p = self.sessions.heard(identity, bad.type, now)
        if bad.code == "bad_message":
            self.replies.bad_message(identity, p.id if p else identity.hex(), bad.reason, bad.header, now)
        else:
            self.replies.refuse(identity, bad.code, bad.reason, bad.header, now)

    @entry
    def on_status(self, identity: bytes, m: StatusAsk, now: float) -> None:
        self.sessions.heard(identity, m.type, now)
        self.out.send(identity, StatusReply(self.status.build(now)))

    @entry
    def on_hello(self, identity: bytes, m: Hello, now: float, key: str | None = None) -> None:
        """`key`: the Curve key's name (None without Curve); a consumer's hello goes on in `on_pipes`."""
        self.sessions.heard(identity, m.type, now)
        self.sessions.hello(identity, m, key, now)

    @entry
    def on_pipes(self, opened: OpenPipes, ports: list[int]) -> None:
        """The server carried out `opened`: `ports` are those that bound, in order."""
        self.sessions.pipes_bound(opened.joining, opened.threads, ports)

    @entry
    def on_lease(self, identity: bytes, m: LeaseAsk, now: float) -> None:
        p = self._session(identity, m, now, ProducerSession)
        if p is None:
            return
        grant = self.work.grant(p, m, len(self.sessions.table.producers()), ending=self.life.end is not None,
                                elastic=self.sessions.lighthouse is not None)
        self.out.send(p.identity, grant)
        if not grant.samples and not grant.end:  # nothing for it: part of another's lease may be
            split = self.work.split_for(p, {q.id: q for q in self.sessions.table.producers()}, now)
            if split is not None:
                self.out.send(split[0].identity, split[1])

    @entry
    def on_release(self, identity: bytes, m: Release, now: float) -> None:
        p = self._session(identity, m, now, ProducerSession)
        if p is not None:
            self.work.released(p, m)

    @entry
    def on_done(self, identity: bytes, m: Done, now: float) -> None:
        p = self._session(identity, m, now, ProducerSession)
        if p is not None:
            self.work.done(p, m, now)

    @entry
    def on_credit(self, identity: bytes, m: Credit, now: float) -> None:
        c = self._session(identity, m, now, ConsumerSession)
        if c is None:
            return
        if m.credit < 0:
            return self.replies.bad_message(c.identity, c.id, f"credit {m.credit} is negative", m.raw, now)
        self.delivery.credit(c, m.credit)

    @entry
    def on_ack(self, identity: bytes, m: Ack, now: float) -> None:
        if (found := self._current_consumer(identity, m, now)) is not None:
            c, lineage = found
            self.commits.acked(c, self.delivery.acked(c, m.batch_ids, m.step, now), lineage, m.step, now)

    @entry
    def on_commit(self, identity: bytes, m: Commit, now: float) -> None:
        if (found := self._current_consumer(identity, m, now)) is None:
            return
        c, lineage = found
        refused = self.commits.refusal(c, m, lineage)
        if refused is None:
            return self.commits.commit(c, m, lineage)
        why, reason = refused
        ok, suppressed = self.replies.allow(f"commit:{c.id}", now)
        if ok:
            log.warning("broker.commit_refused", peer=c.id, why=why, step=m.step, lineage=clip(lineage) or None,
                        checkpoint=clip(m.checkpoint), acked_step=c.lineage_steps.get(lineage), peer_host=c.host,
                        suppressed=suppressed)
        self.replies.refuse(c.identity, "commit_refused", reason, m.raw, now)

    @entry
    def on_lineage(self, identity: bytes, m: LineageStart, now: float) -> None:
        c = self._session(identity, m, now, ConsumerSession)
        if c is None:
            return
        why = self.commits.stale_start(c, m)
        if why is not None:  # the newest commit must be in the new weights, or its samples are lost
            self.replies.refuse(c.identity, "stale_checkpoint", why, m.raw, now)
            return self._drop(c, "lost", "started from a checkpoint older than the newest commit", now)
        rewound = self.commits.start(c, m)
        self.commits.started_by(c, m)
        if rewound is not None and self.life.job_lost is not None and not self.commits.trained:
            # what only the dead weights held is being made again
            log.info("broker.job_resumed", peer=c.id, lineage=m.lineage[:MAX_LINEAGE], step=m.step,
                     rewound_samples=rewound)
            self.life.job_lost = None
            if self.life.phase is Phase.JOB_LOST:
                self.life.phase = Phase.RUNNING

    @entry
    def on_heartbeat(self, identity: bytes, m: Heartbeat, now: float) -> None:
        p = self._session(identity, m, now)
        if p is not None:
            self.sessions.heartbeat(p, m, now)

    @entry
    def on_bye(self, identity: bytes, m: Bye, now: float) -> None:
        p = self._session(identity, m, now)
        if p is not None:
            self._drop(p, "left", m.reason[:200], now)

    @entry
    def on_failed(self, identity: bytes, m: Failed, now: float) -> None:
        """A peer stops on an error (PROTOCOL.md 4.2); a consumer's `bad_batch` counts against that batch."""
        p = self._session(identity, m, now)
        if p is None:
            return
        failure = self.sessions.failed(p, m)
        batch = {}
        if isinstance(p, ConsumerSession) and m.code == "bad_batch" and isinstance(m.batch_id, str):
            fault = m.fault if isinstance(m.fault, str) and m.fault else "unknown"
            batch = self.delivery.failed_on(p, m.batch_id, fault, m.reason)
        if self.replies.allow(f"failed:{p.id}", now)[0]:
            log.warning("broker.peer_failed", **p.describe(), **failure.fields(), **batch)

    def _session(self, identity: bytes, m: Message, now: float, role: type[Session] = Session):
        """The live session that sent `m` if it may send it; else the sender is refused and None returned."""
        p = self.sessions.heard(identity, m.type, now)
        if p is None:
            self.replies.refuse(identity, "unknown_peer", UNKNOWN_PEER, m.raw, now)
            return None
        if not isinstance(p, role):
            self.replies.bad_message(identity, p.id, f"{m.type!r} is not accepted from a {p.role}", m.raw, now)
            return None
        return p

    # ------------------------------------------------------------ data in and out

    @entry
    def on_batch(self, arrival: Arrival, now: float) -> None:
        """A batch on data in; its frames stay with the server, kept while `holds` its ID."""
        named = self.sessions.table.by_id.get(arrival.batch.producer)
        why = self.intake.accept(arrival, named, now)
        if why is not None:  # its own producer sent a batch that does not fit the run
            self._drop(named, "lost", why, now)

    @entry
    def on_bad_batch(self, bad: BadBatch, now: float) -> None:
        """A data-in message the codec refused."""
        self.replies.log_bad("data_in", bad.sender, bad.reason, now, **connection_fields(bad.conn))

    def dispatch(self, now: float) -> Relay | None:
        """The first queued batch to relay to a consumer with credit (PROTOCOL.md 4.5), or None."""
        return self.delivery.dispatch(self.sessions.table.consumers(), now, draining=self.life.phase is Phase.DRAINING)

    def relayed(self, relay: Relay, port: int | None, now: float) -> Relay | None:
        """`relay` went out on `port` (None: no pipe took it, it stays queued); returns the next, or None."""
        return self.delivery.relayed(relay, port, now)

    # ------------------------------------------------------------ time and signals

    def on_signal(self, name: str, count: int) -> None:
        """The server saw SIGINT/SIGTERM (`count` so far); acted on at the next tick."""
        self.life.signal, self.life.signals = name, count

    @entry
    def tick(self, now: float) -> None:
        life = self.life
        if now - self.last_tick < TICK_S and life.signal is None:
            return
        if life.signal is not None and (life.phase in (Phase.RUNNING, Phase.JOB_LOST)
                                        or (life.phase is Phase.ENDING and life.signals > 1)):
            self._shutdown(f"signal {life.signal}", now)
        if life.phase is Phase.DRAINING and self._drained(now):
            return
        if life.phase is Phase.DONE:
            return
        if not self.delivery.queue.has_room():
            self.work.pool.hold_clocks(now - self.last_tick)
        self.last_tick = now
        for p, why in self.sessions.silent(now):
            self._drop(p, "lost", why, now)
        for c, why in self.sessions.overdue_acks(now):
            self._drop(c, "lost", why, now)
        self.work.incomplete(now)
        if life.phase is not Phase.DRAINING:
            self._budget_plan(now)
        if self.beat.due(now):
            beat = Heartbeat(self.status.heartbeat_stats(), planned_samples=self.status.planned_samples(),
                             budget_progress=None if self.budget is None else round(self.budget.progress(now), 6))
            for p in self.sessions.table.live():
                self.out.send(p.identity, beat)
            if self.publish_status:
                self.out.publish(self.status.build(now))
        if self.progress.due(now):
            self.status.log_progress(now)
        self.ledger.maybe_flush(now)
        self.replies.gate.report(now)
        if life.phase is not Phase.DRAINING:
            self._check_end_of_stream()

    def report(self, now: float) -> None:
        """The loop ends: log what the rate limits left out, so no suppressed count goes unsaid."""
        self.replies.gate.report(now, force=True)

    # ------------------------------------------------------------ sessions that end

    def _drop(self, p: Session, state: str, reason: str, now: float) -> None:
        """End a session (state 'lost' or 'left'): give back what it held, log what that was."""
        silent_s = round(now - p.last_seen, 3)
        held = self.delivery.take_back(p) if isinstance(p, ConsumerSession) else self.work.release(p)
        self.sessions.remove(p, state, reason, held, now)
        if isinstance(p, ConsumerSession):
            self._check_job(p, state, reason)
        self.sessions.log_gone(p, silent_s)

    def _current_consumer(self, identity: bytes, m: Ack | Commit, now: float) -> tuple[ConsumerSession, str] | None:
        """The consumer that sent an ack or commit and its lineage; None when refused (a superseded
        lineage also ends the session)."""
        c = self._session(identity, m, now, ConsumerSession)
        if c is None:
            return None
        lineage = lineage_of(m.lineage)
        why = self.commits.superseded(c, m.type, lineage, m.step)
        if why is None:
            return c, lineage
        self.replies.refuse(c.identity, "lineage_superseded", why, None, now)
        self._drop(c, "lost", f"{m.type} from a superseded lineage", now)
        return None

    def _check_job(self, c: ConsumerSession, state: str, reason: str) -> None:
        """The last consumer left with trained, uncommitted samples: they lived only in its weights and
        their batches are gone, so the run refuses joiners (`job_lost`) until it is resumed."""
        trained, life = self.ledger.counts["trained"], self.life
        if life.phase is Phase.RUNNING and life.job_lost is None and trained > 0 and not self.sessions.table.consumers():
            life.job_lost = JobLost(c.id, state, reason, trained)
            life.phase = Phase.JOB_LOST
            last = self.ledger.last_commit
            log.warning("broker.job_lost", peer=c.id, state=state, reason=reason, trained=trained,
                        last_commit=list(last) if last else None, hint=f"restart with dflash-broker --resume {self.run_id}")

    # ------------------------------------------------------------ the time budget

    def _budget_plan(self, now: float) -> None:
        """--time-budget: re-plan when due or when the plan is trained early; nothing is leased past it."""
        budget, pool = self.budget, self.work.pool
        if budget is None or not pool.known or self.life.phase not in (Phase.RUNNING, Phase.JOB_LOST):
            return
        c = self.ledger.counts
        inherited = c.get("inherited", 0)
        budget.observe(now, self.commits.rate_samples.total)
        done = c["trained"] + c["committed"] + c["skipped"] + c["quarantined"] + inherited
        budget.dataset_done, budget.dataset_total = done, pool.n_samples * self.cfg.epochs
        drained = (budget.last is not None and pool.finished() and pool.capped and not self.delivery.queue
                   and not any(x.in_flight for x in self.sessions.table.consumers()))
        if budget.due(now) or drained:
            total = pool.n_samples * self.cfg.epochs
            fig = budget.plan(now, done=done, leased=inherited + pool.taken, total=total,
                              rate=budget.rate(now), reason="drained" if drained else None)
            log.info("broker.plan", budget_s=budget.budget_s, elapsed_s=fig.elapsed_s, left_s=fig.left_s,
                     reserve_s=budget.reserve_s, rate=fig.rate, planned_samples=fig.planned_samples, done=fig.done,
                     leased=fig.leased, samples_total=total, reason=fig.reason)
        # the warm-up's lead: the leases the producers may hold open at once (leases.py)
        lead = self.cfg.lease_size * MAX_OPEN_LEASES * max(1, len(self.sessions.table.producers()))
        pool.limit = max(0, budget.lease_limit(done, lead) - inherited)

    # ------------------------------------------------------------ the end of the run

    def _check_end_of_stream(self) -> None:
        """PROTOCOL.md 4.6: all produced or skipped, queue empty, everything acked -> stop."""
        life, table = self.life, self.sessions.table
        if life.phase in (Phase.RUNNING, Phase.JOB_LOST):
            consumers = table.consumers()
            if self.work.pool.finished() and not self.delivery.queue and not any(c.in_flight for c in consumers):
                log.info("broker.end_of_stream", consumers=[c.id for c in consumers],
                         producers=[p.id for p in table.producers()], batches=self.delivery.rate_in.total,
                         samples=dict(self.ledger.counts), bad_batches=self.poison.as_dict())
                self._stop_all("end_of_stream")
                life.phase = Phase.ENDING
        elif life.phase is Phase.ENDING and not any(pid in table.by_id for pid in life.end.told):
            self.ledger.flush()
            outcome, why = runinfo.end_of_stream_outcome(self.ledger, self.work.pool)
            log.info("broker.stop", reason="end_of_stream", outcome=outcome)
            life.finish(outcome, why)

    def _stop_all(self, reason: str) -> None:
        """Tell every live peer to stop (PROTOCOL.md 4.6); peers joining later are told too."""
        live = self.sessions.table.live()
        self.life.end = RunEnd(reason, {p.id for p in live})
        for p in live:
            self.out.send(p.identity, Stop(reason))

    def _shutdown(self, cause: str, now: float) -> None:
        """SIGINT/SIGTERM: tell peers to stop, then drain (PROTOCOL.md 4.6): consumers commit a checkpoint
        on stop, so serve acks and commits until all left, --drain-s passed or a second signal came."""
        self._stop_all("shutdown")
        end = self.life.end
        end.deadline, end.cause = now + self.cfg.drain_s, cause
        self.life.phase = Phase.DRAINING
        self.ledger.flush()
        log.info("broker.draining", reason=cause, peers=sorted(end.told), drain_s=self.cfg.drain_s)

    def _drained(self, now: float) -> bool:
        """End the loop once no peer told to stop is left (or the drain is over)."""
        end, signals = self.life.end, self.life.signals
        left = sorted(pid for pid in end.told if pid in self.sessions.table.by_id)
        if left and now < end.deadline and signals < 2:
            return False
        self.ledger.flush()
        why = "drained" if not left else ("second signal" if signals >= 2 else "drain_s passed")
        log.info("broker.stop", reason=end.cause, outcome="interrupted", drain=why, peers_left=left,
                 **self.status.progress_fields(now))
        self.life.finish("interrupted")
        return True

    @entry
    def close(self) -> None:
        """The broker stops: every consumer's pipes close and the ledger is written and closed."""
        self.sessions.close_pipes()
        self.ledger.close()


def endpoints(cfg: BrokerConfig, advertise: str) -> dict:
    """The endpoints peers dial, as the welcome and the status map name them."""
    eps = {"control": f"tcp://{advertise}:{cfg.port}", "data_in": f"tcp://{advertise}:{cfg.data_in_port}"}
    if cfg.metrics_port:
        eps["metrics"] = f"http://{advertise}:{cfg.metrics_port}/metrics"
    return eps
