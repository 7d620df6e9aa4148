"""The broker's state machine without sockets (as vLLM's EngineCore beside EngineCoreProc).

`BrokerCore` holds the run: peers, the queue, leases, the ledger, lineages and the run's
phase. Each entry point takes one typed message (inbound.py) and returns the actions
(actions.py) that server.py carries out with its sockets; `tick(now)` runs the timers.
It imports no ZeroMQ, so its policy (exactly-once, handshake, leases, end of stream,
shutdown) is tested in-process (tests/broker/test_core.py).

What to do with each message lives in control.py (producers, consumers, lost peers),
handshake.py (hello), intake.py (batches); the policy in dispatch.py, leases.py,
liveness.py, lineage.py and ledger.py.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Callable

from dflash.protocol.messages import Message, StatusReply, Stop
from dflash.runtime.logs import get_logger

from . import control, handshake, intake, resume
from .actions import Action, ClosePipes, Publish, Send
from .config import MAX_CREDIT, BrokerConfig
from .dispatch import BatchQueue, QueuedBatch, dispatch, wants_batch
from .inbound import Ack, Batch, Bye, Commit, Credit, Done, Failed, Heartbeat, Hello, LeaseAsk, LineageStart
from .leases import LeasePool
from .ledger import Ledger
from .lineage import Lineages, TrainedBatch
from .liveness import Every, RateLimit, RateMeter, TimeShare, silent
from .peers import Peer, PeerTable
from .phase import JobLost, Phase, RunEnd  # noqa: F401  (JobLost: for readers of core.job_lost)
from .quarantine import Poison
from .replies import LogGate, log_bad
from .resume import Parent
from .status import build_status, log_progress, progress_fields, samples

log = get_logger()

# Timers run at most this often. At thousands of small batches a second the loop turns
# once per message, and the timer checks would cost as much as the message itself.
TICK_S = 0.005


# bind(port, io_thread_mask) -> a pipe (PUSH socket) bound there, or None when the port is taken
PipeBinder = Callable[[int, int], object | None]


def entry(fn):
    """An entry point: returns the actions it queued (nested entries leave them to the outer).
    If it raises (the server logs broker.internal_error), what it queued goes out with the
    next entry's actions, as the old loop had sent it before the error."""

    @functools.wraps(fn)
    def run(self, *args, **kwargs) -> list[Action]:
        self._depth += 1
        try:
            fn(self, *args, **kwargs)
        finally:
            self._depth -= 1
        if self._depth:
            return []
        out, self._out = self._out, []
        return out

    return run


class BrokerCore:
    def __init__(self, cfg: BrokerConfig, run_id: str, run_dir: Path, hostname: str, *,
                 parent: Parent | None = None, bind_pipe: PipeBinder, pipe_threads: list[int] | None = None,
                 streams: int = 1, producer_streams: int = 1, lighthouse: str | None = None,
                 now: float | None = None):
        """`bind_pipe` binds a consumer's data-out port; `pipe_threads` are the I/O threads
        (affinity masks) pipes may take; `streams` pipes per consumer, `producer_streams`
        connections per producer; `lighthouse` the elastic consumers' lighthouse address."""
        self.cfg, self.run_id, self.run_dir, self.hostname = cfg, run_id, Path(run_dir), hostname
        self.parent = parent  # the run this one resumes (resume.py), or None
        self.advertise = cfg.host_to_advertise(hostname)
        now = time.monotonic() if now is None else now
        self.started_at, self.started_mono = time.time(), now
        self.bind_pipe, self.pipe_threads = bind_pipe, pipe_threads or [0]
        self.streams, self.producer_streams = streams, producer_streams
        self.lighthouse = lighthouse
        self.peers = PeerTable()
        self.queue = BatchQueue(cfg.queue_bytes)
        self.batch_ids: set[str] = set()  # queued or in flight: a batch_id is unique in the run
        self.leases = LeasePool(cfg.epochs, cfg.seed, cfg.num_samples, parent.committed if parent else None)
        self.ledger = Ledger(self.run_dir / "ledger.sqlite")
        self.facts: dict = {}  # target, layer_ids, hidden_size, dataset: fixed by the first producer
        if cfg.num_samples is not None:
            self.facts["dataset"] = {"n_samples": cfg.num_samples, "fingerprint": None}
        if parent is not None:  # before any socket exists: no work goes out before this is on disk
            self.facts.update(parent.facts)
            resume.inherit(self.ledger, parent)
        self.dist: str | None = None  # rank 0's rendezvous endpoint
        self.next_port = cfg.data_out_ports[0]
        self.phase = Phase.RUNNING
        self.end: RunEnd | None = None  # set once peers are told to stop
        self.job_lost: JobLost | None = None  # (control.check_job)
        self.signal: str | None = None  # the latest SIGINT/SIGTERM, as the server saw it
        self.signals = 0  # how many: a second one ends a shutdown's drain at once
        self.lineages = Lineages()  # whose weights hold what (lineage.py)
        self.trained: dict[str, TrainedBatch] = {}  # acked, not yet committed, by batch ID
        self.poison = Poison(cfg.quarantine_after)  # batches refused or quarantined (quarantine.py)
        self.blocked = False  # a batch waits on a consumer pipe that is not connected yet
        self.last_tick = now
        self.beat, self.progress = Every(cfg.heartbeat_s, now), Every(cfg.progress_s, now)
        self.log_limit, self.reply_limit = LogGate(), RateLimit(3.0)
        self.rate_in, self.rate_out = RateMeter(), RateMeter()
        self.rate_samples = RateMeter(window_s=60.0)  # samples acked per second: the ETA
        self.full_share = TimeShare()  # how much of the last 10 s producers were blocked
        self.publish_status = bool(cfg.metrics_port)  # the --metrics-port endpoint wants the map
        self.metric_sink = None  # --tensorboard / --wandb (runtime/sinks.py)
        self.last_diagnosis: str | None = None  # logged as broker.diagnosis when it changes
        self.peer_messages = 0  # control messages other than status asks, refused ones included
        self._out: list[Action] = []
        self._depth = 0

    @property
    def endpoints(self) -> dict:
        eps = {"control": endpoint(self.advertise, self.cfg.port),
               "data_in": endpoint(self.advertise, self.cfg.data_in_port)}
        if self.cfg.metrics_port:
            eps["metrics"] = f"http://{self.advertise}:{self.cfg.metrics_port}/metrics"
        return eps

    def status(self) -> dict:
        """The status map (status.py; `status_reply.status`)."""
        return build_status(self)

    @property
    def outcome(self) -> str | None:
        return self.end.outcome if self.end is not None else None

    # ------------------------------------------------------------ actions

    def send(self, identity: bytes, msg: Message) -> None:
        self._out.append(Send(identity, msg))

    def close_pipes(self, p: Peer) -> None:
        """A consumer's session ended: its data-out pipes are closed."""
        self.discard_pipes(p.pipes)
        p.pipes, p.pipe_threads = [], []

    def discard_pipes(self, pipes: list) -> None:
        if pipes:
            self._out.append(ClosePipes(list(pipes)))

    # ------------------------------------------------------------ control messages

    @entry
    def on_control(self, identity: bytes, h: dict | None, error: str | None = None, key: str | None = None,
                   now: float | None = None) -> None:
        """One control message from ROUTER `identity`: its header `h` (None if it did not
        parse), `error` if it failed the codec's checks, `key` the Curve key name it came
        with. Checks in the order PROTOCOL.md 3 gives, then routes by type."""
        control.handle(self, identity, h, error, key, time.monotonic() if now is None else now)

    @entry
    def on_hello(self, identity: bytes, msg: Hello, key: str | None = None) -> None:
        handshake.hello(self, identity, msg, key)

    @entry
    def on_status(self, identity: bytes) -> None:
        self.send(identity, StatusReply(self.status()))

    # One typed message each from live session `p`, after the checks of on_control (which
    # routes here through control.HANDLERS); what each does is in control.py.

    @entry
    def on_lease(self, p: Peer, m: LeaseAsk) -> None:
        control.on_lease(self, p, m)

    @entry
    def on_done(self, p: Peer, m: Done) -> None:
        control.on_done(self, p, m)

    @entry
    def on_credit(self, p: Peer, m: Credit) -> None:
        control.on_credit(self, p, m)

    @entry
    def on_ack(self, p: Peer, m: Ack) -> None:
        control.on_ack(self, p, m)

    @entry
    def on_commit(self, p: Peer, m: Commit) -> None:
        control.on_commit(self, p, m)

    @entry
    def on_lineage(self, p: Peer, m: LineageStart) -> None:
        control.on_lineage(self, p, m)

    @entry
    def on_heartbeat(self, p: Peer, m: Heartbeat) -> None:
        control.on_heartbeat(self, p, m)

    @entry
    def on_bye(self, p: Peer, m: Bye) -> None:
        control.on_bye(self, p, m)

    @entry
    def on_failed(self, p: Peer, m: Failed) -> None:
        control.on_failed(self, p, m)

    # ------------------------------------------------------------ data in

    @entry
    def on_batch(self, batch: Batch, now: float | None = None) -> None:
        intake.accept(self, batch, time.monotonic() if now is None else now)

    @entry
    def on_bad_batch(self, sender: str, reason: str, conn: dict | None = None) -> None:
        """A data-in message the codec refused (`sender` as server.sender names it, `conn`
        its connection as inbound.connection describes it)."""
        log_bad(self, "data_in", sender, reason, **intake.connection_fields(conn or {}))

    # ------------------------------------------------------------ dispatch

    def dispatch(self, relay: Callable[[Peer, QueuedBatch], bool], now: float | None = None) -> list:
        """Hand queued batches to consumers by credit; `relay(consumer, batch)` is the
        server's non-blocking send (False: that pipe cannot take it now)."""
        now = time.monotonic() if now is None else now
        if self.phase is Phase.DRAINING:  # stopping consumers train nothing more: keep batches here
            self.blocked = False
            return []
        consumers = self.peers.live("consumer")
        sent = dispatch(self.queue, consumers, relay) if self.queue else ()
        for c, b in sent:
            self.ledger.delivered(b, c.id)
            c.delivered += 1
            c.rate_in.add(1, now)
            c.rate_tokens.add(b.tokens, now)
            self.rate_out.add(1, now)
        # Batches left while a consumer wants one: its pipe refused (not connected yet).
        self.blocked = bool(self.queue) and any(wants_batch(c) for c in consumers)
        for c in consumers:  # how long a consumer has had credit and no batch
            hungry = c.credit > 0 and not self.queue
            c.waiting_since = (c.waiting_since or now) if hungry else None
            c.wait_share.update(hungry, now)
        self.full_share.update(not self.queue.has_room(), now)
        return list(sent)

    # ------------------------------------------------------------ time and signals

    def on_signal(self, name: str, count: int) -> None:
        """The server saw SIGINT/SIGTERM (`count` so far); acted on at the next tick."""
        self.signal, self.signals = name, count

    @entry
    def tick(self, now: float) -> None:
        if now - self.last_tick < TICK_S and self.signal is None:
            return
        if self.signal is not None and (self.phase in (Phase.RUNNING, Phase.JOB_LOST)
                                        or (self.phase is Phase.ENDING and self.signals > 1)):
            # (a first signal during end of stream changes nothing: the run is ending anyway)
            self.shutdown(f"signal {self.signal}", now)
        if self.phase is Phase.DRAINING and self._drained(now):
            return
        if self.phase is Phase.DONE:
            return
        if not self.queue.has_room():
            self.leases.hold_clocks(now - self.last_tick)
        self.last_tick = now
        for p in silent(self.peers.live(), now, self.cfg.timeout_s):
            control.drop(self, p, "lost", f"silent for {now - p.last_seen:.1f}s (timeout {self.cfg.timeout_s}s)")
        control.check_acks(self, now)
        for lease in self.leases.overdue(now, self.cfg.timeout_s):
            control.lease_incomplete(self, lease)
        if self.beat.due(now):
            self.heartbeat_all()
            if self.publish_status:
                self._out.append(Publish(build_status(self)))
        if self.progress.due(now):
            log_progress(self, now)
        self.ledger.maybe_flush(now)
        self.log_limit.report(now)
        if self.phase is not Phase.DRAINING:
            control.check_end_of_stream(self)

    def heartbeat_all(self) -> None:
        stats = {
            "queue_batches": len(self.queue),
            "queue_bytes": self.queue.bytes,
            "q_pre": {p.id: p.stats.get("q_pre") for p in self.peers.live("producer")},
            "in_flight": {c.id: len(c.in_flight) for c in self.peers.live("consumer")},
            "max_credit": MAX_CREDIT,
            # a consumer that restarts from a checkpoint takes this one, newer than its welcome's
            "last_commit": control.last_commit(self),
        }
        # Run progress, so consumers can log the epoch fraction and an ETA from what
        # only the broker knows (PROTOCOL.md 4.2); None until a producer fixed n_samples.
        s = samples(self)
        # Samples set aside as poison count as skipped: never trained, out of a consumer's schedule.
        stats.update(samples_total=s["total"], samples_done=s["done"],
                     samples_skipped=s["skipped"] + s["quarantined"], n_samples=s["n_samples"], epoch=s["epoch"],
                     epochs=s["epochs"])
        # The run's facts its first producer fixed: a consumer that joined before any producer
        # waits for the target layers here rather than guess them (PROTOCOL.md 4.2).
        stats["run_facts"] = {k: self.facts.get(k) for k in ("layer_ids", "hidden_size", "target_id")}
        beat = Heartbeat(stats)
        for p in self.peers.live():
            self.send(p.identity, beat)

    # ------------------------------------------------------------ the end of the run

    def stop_all(self, reason: str) -> None:
        """Tell every live peer to stop (PROTOCOL.md 4.6); peers joining later are told too."""
        self.end = RunEnd(reason, {p.id for p in self.peers.live()})
        for p in self.peers.live():
            self.send(p.identity, Stop(reason))

    def shutdown(self, cause: str, now: float | None = None) -> None:
        """SIGINT/SIGTERM: tell every live peer to stop, then drain (PROTOCOL.md 4.6).

        Consumers answer `stop {shutdown}` by finishing their step, writing a checkpoint
        and committing it: the broker must still be here to record that commit, or the
        samples trained since the last one are made and trained again after resume. So it
        keeps serving acks, commits and byes (sending no batch, granting no lease) until
        every peer has left or was lost, at most --drain-s; a second signal ends the wait."""
        now = time.monotonic() if now is None else now
        self.stop_all("shutdown")
        self.end.deadline, self.end.cause = now + self.cfg.drain_s, cause
        self.phase = Phase.DRAINING
        self.ledger.flush()
        log.info("broker.draining", reason=cause, peers=sorted(self.end.told), drain_s=self.cfg.drain_s)

    def _drained(self, now: float) -> bool:
        """End the loop once no peer told to stop is left (or the drain is over)."""
        left = sorted(pid for pid in self.end.told if pid in self.peers.by_id)
        if left and now < self.end.deadline and self.signals < 2:
            return False
        self.ledger.flush()
        why = "drained" if not left else ("second signal" if self.signals >= 2 else "drain_s passed")
        log.info("broker.stop", reason=self.end.cause, outcome="interrupted", drain=why, peers_left=left,
                 **progress_fields(self, now))
        self.finish("interrupted")
        return True

    def finish(self, outcome: str, why: str | None = None) -> None:
        self.end.outcome, self.end.outcome_why = outcome, why
        self.phase = Phase.DONE

    def close(self) -> None:
        """Release the ledger (what is queued is written first)."""
        self.ledger.close()


def endpoint(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"
