"""The broker: sockets, one loop, and the few actions the loop takes.

    control  ROUTER  <- hello/lease/done/credit/ack/commit/heartbeat/bye/status
    data in  PULL    <- batches from producers (read only while the queue has room)
    data out PUSH x consumers -> one pipe each, sent only against that consumer's credit

What to do with each message lives in control.py / intake.py; policy in dispatch.py,
leases.py, liveness.py and ledger.py. Everything here runs on one thread, so nothing is
locked. Every send is NOBLOCK: a slow or dead peer never stalls the loop.
"""

from __future__ import annotations

import time

import zmq

from dflash.protocol import codec
from dflash.protocol.gcpause import freeze_setup
from dflash.protocol.logs import get_logger
from dflash.protocol.messages import PRE_HANDSHAKE, header
from dflash.protocol.sockets import SocketOpts, first_thread, make_socket, readable, recv_frames, send_frames, tcp_endpoint

from . import control, intake, lighthouse, resume, security
from .config import (CONTROL_MAX_BYTES, CONTROL_RCVHWM, CONTROL_SNDHWM, DATA_IN_RCVHWM, MAX_CREDIT, BrokerConfig,
                     data_in_frame_cap)
from .lineage import Lineages, TrainedBatch
from .dispatch import BatchQueue, QueuedBatch, dispatch, wants_batch
from .leases import LeasePool
from .ledger import Ledger
from .liveness import Every, RateLimit, RateMeter, TimeShare, silent
from .metrics import MetricsServer
from .peers import Peer, PeerTable
from .replies import LogGate
from .resume import Parent
from .status import build_status, log_progress, progress_fields, samples

log = get_logger()

POLL_MS = 100  # longest the loop sleeps: timers (heartbeats, expiry) run at this grain
BLOCKED_POLL_MS = 5  # a batch waits on a pipe that is not connected yet: look again soon
DRAIN_MAX = 256  # messages read per socket per turn, so one busy socket cannot starve the other
# Timers run at most this often. At thousands of small batches a second the loop turns
# once per message, and the timer checks would cost as much as the message itself.
TICK_S = 0.005
RECHECK_MS = 50  # before dropping a silent peer, how long to wait for what is on its way


class Broker:
    def __init__(self, cfg: BrokerConfig, run_id: str, run_dir, hostname: str, parent: Parent | None = None):
        """Bind the control and data-in sockets. Raises zmq.ZMQError (e.g. a port in use),
        CurveKeyError (with --curve-keys: a key file missing)."""
        self.cfg, self.run_id, self.run_dir, self.hostname = cfg, run_id, run_dir, hostname
        self.parent = parent  # the run this one resumes (resume.py), or None
        self.advertise = cfg.host_to_advertise(hostname)
        self.started_at, self.started_mono = time.time(), time.monotonic()
        self.peers = PeerTable()
        self.queue = BatchQueue(cfg.queue_bytes)
        self.batch_ids: set[str] = set()  # queued or in flight: a batch_id is unique in the run
        self.leases = LeasePool(cfg.epochs, cfg.seed, cfg.num_samples, parent.committed if parent else None)
        self.ledger = Ledger(run_dir / "ledger.sqlite")
        self.facts: dict = {}  # target, layer_ids, hidden_size, dataset: fixed by the first producer
        if cfg.num_samples is not None:
            self.facts["dataset"] = {"n_samples": cfg.num_samples, "fingerprint": None}
        if parent is not None:  # before any socket exists: no work goes out before this is on disk
            self.facts.update(parent.facts)
            resume.inherit(self.ledger, parent)
        self.dist: str | None = None  # rank 0's rendezvous endpoint
        self.next_port = cfg.data_out_ports[0]
        self.stopping: set[str] | None = None  # peers sent `stop` at end of stream
        self.outcome: str | None = None
        self.signal: str | None = None  # set by the signal handler, acted on in the loop
        self.signals = 0  # SIGINT/SIGTERM received: a second one ends a shutdown's drain at once
        self.stop_reason = "end_of_stream"  # what `stop` says: end_of_stream, or shutdown (signal)
        self.draining: float | None = None  # a shutdown's deadline (monotonic), while it waits for peers
        self.job_lost: dict | None = None  # the training job died with uncommitted work (control.check_job)
        self.lineages = Lineages()  # whose weights hold what (lineage.py)
        self.trained: dict[str, TrainedBatch] = {}  # acked, not yet committed, by batch ID
        self.blocked = False
        self.last_tick = time.monotonic()
        self.beat, self.progress = Every(cfg.heartbeat_s), Every(cfg.progress_s)
        self.log_limit, self.reply_limit = LogGate(), RateLimit(3.0)
        self.rate_in, self.rate_out = RateMeter(), RateMeter()
        self.rate_samples = RateMeter(window_s=60.0)  # samples acked per second: the ETA
        self.full_share = TimeShare()  # how much of the last 10 s producers were blocked
        self.metrics = None  # the --metrics-port HTTP endpoint (metrics.MetricsServer)
        self.lighthouse = None  # elastic consumers' torchft lighthouse (lighthouse.py)
        self.last_diagnosis: str | None = None  # logged as broker.diagnosis when it changes
        self.io_threads = cfg.io_thread_count()
        self.ctx = zmq.Context(io_threads=self.io_threads)
        # Data connections per consumer and per producer: one per I/O thread of that direction.
        self.streams = cfg.stream_count(bin(self.out_affinity).count("1"))
        self.producer_streams = cfg.stream_count(bin(self.in_affinity).count("1"))
        self.curve, self.auth = None, None
        try:
            # ZAP first: libzmq admits every client while no authenticator runs.
            self.curve, self.auth = security.setup(cfg.curve_keys, self.ctx)
            self.control = make_socket(
                self.ctx, zmq.ROUTER, tcp_endpoint(cfg.bind, cfg.port), bind=True,
                opts=SocketOpts(sndhwm=CONTROL_SNDHWM, rcvhwm=CONTROL_RCVHWM, maxmsgsize=CONTROL_MAX_BYTES,
                                curve=self.curve, affinity=self.control_affinity),
            )
            self.data_in = make_socket(
                self.ctx, zmq.PULL, tcp_endpoint(cfg.bind, cfg.data_in_port), bind=True,
                opts=SocketOpts(rcvhwm=DATA_IN_RCVHWM, maxmsgsize=data_in_frame_cap(cfg.max_message_bytes),
                                curve=self.curve,
                                affinity=self.in_affinity),
            )
            if cfg.metrics_port:  # bound with the sockets: a port in use stops the start
                self.metrics = MetricsServer(cfg.bind, cfg.metrics_port)
            if cfg.elastic and cfg.consumers >= 2:  # consumers meet there every step
                self.lighthouse = lighthouse.start(cfg.bind, cfg.lighthouse_port, self.advertise, cfg.timeout_s)
        except Exception:
            self.close()
            raise

    # I/O threads by role (ZMQ_AFFINITY masks; 0 = any, with one thread). libzmq puts a new
    # connection on the least loaded thread of its socket's mask, counting every socket
    # there, so control (a connection per peer) shares a thread with data only where there
    # are two: then control and batches in on the first, the consumers' pipes on the second.
    # From three up control has the first alone, batches in the next (n-1)//2, pipes the
    # rest. With five producers on one thread, that thread was the limit (0.98 of a core at
    # 6.9 GB/s, bench/scaling.py 5x3 on 32 cores).

    @property
    def control_affinity(self) -> int:
        return first_thread(self.io_threads)

    @property
    def in_affinity(self) -> int:
        n = self.io_threads
        if n < 3:
            return first_thread(n)
        return ((1 << (1 + (n - 1) // 2)) - 1) & ~1

    @property
    def out_affinity(self) -> int:
        n = self.io_threads
        if n < 2:
            return 0
        return ((1 << n) - 1) & ~self.in_affinity & ~self.control_affinity

    @property
    def pipe_threads(self) -> list[int]:
        """The consumers' pipe threads, one affinity mask each ([0] = any, with one thread)."""
        return [1 << i for i in range(self.io_threads) if self.out_affinity >> i & 1] or [0]

    @property
    def endpoints(self) -> dict:
        eps = {"control": tcp_endpoint(self.advertise, self.cfg.port),
               "data_in": tcp_endpoint(self.advertise, self.cfg.data_in_port)}
        if self.cfg.metrics_port:
            eps["metrics"] = f"http://{self.advertise}:{self.cfg.metrics_port}/metrics"
        return eps

    # ------------------------------------------------------------ the loop

    def serve(self) -> str:
        """Run until end of stream or a signal; returns the outcome for run.json."""
        freeze_setup()  # imports and setup: a full GC pass would stall the loop (protocol/gcpause.py)
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.data_in, zmq.POLLIN)
        while self.outcome is None:
            # zguide lbbroker: read producers only while the queue has room. A full
            # broker stops reading, the producers' PUSH pipes fill, their sends block.
            poller.modify(self.data_in, zmq.POLLIN if self.queue.has_room() else 0)
            events = dict(poller.poll(BLOCKED_POLL_MS if self.blocked else POLL_MS))
            if self.control in events:
                self._drain(self.control, lambda f: control.handle(self, f[0].bytes, f[1:]))
            if self.data_in in events:
                self._drain(self.data_in, lambda f: intake.handle(self, f), while_room=True)
            self.dispatch()
            self.tick(time.monotonic())
        self.log_limit.report(time.monotonic(), force=True)  # no suppressed count goes unsaid
        return self.outcome

    def _drain(self, sock: zmq.Socket, handle, while_room: bool = False) -> None:
        for _ in range(DRAIN_MAX):
            if while_room and not self.queue.has_room():
                return
            try:
                frames = recv_frames(sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                handle(frames)
            except Exception:  # a bug on one message must not end the run
                log.exception("broker.internal_error", socket="control" if sock is self.control else "data_in")
            if not readable(sock):  # cheaper than the zmq.Again a last recv would raise
                return

    def dispatch(self) -> None:
        if self.draining is not None:  # stopping consumers train nothing more: keep batches here
            self.blocked = False
            return
        consumers = self.peers.live("consumer")
        sent = dispatch(self.queue, consumers, self._send_batch) if self.queue else ()
        now = time.monotonic()
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

    def _send_batch(self, c: Peer, b: QueuedBatch) -> bool:
        """Send on the consumer's next data stream that takes it (streams in turn)."""
        n = len(c.pipes)
        for i in range(n):
            s = (c.next_stream + i) % n
            try:
                # The very frames that came in, tensor buffers untouched (copy=False).
                send_frames(c.pipes[s], b.frames, zmq.NOBLOCK)
            except zmq.Again:  # not connected (yet), or full: try the next stream
                continue
            c.next_stream = s + 1
            return True
        return False  # no stream took it: the batch stays queued

    def tick(self, now: float) -> None:
        if now - self.last_tick < TICK_S and self.signal is None:
            return
        if self.signal is not None and self.draining is None and (self.stop_reason != "end_of_stream"
                                                                  or self.stopping is None or self.signals > 1):
            # (a first signal during end of stream changes nothing: the run is ending anyway)
            self.shutdown(f"signal {self.signal}")
        if self.draining is not None and self._drained(now):
            return
        if not self.queue.has_room():
            self.leases.hold_clocks(now - self.last_tick)
        self.last_tick = now
        for p in self._silent(now):
            control.drop(self, p, "lost", f"silent for {now - p.last_seen:.1f}s (timeout {self.cfg.timeout_s}s)")
        control.check_acks(self, now)
        for lease in self.leases.overdue(now, self.cfg.timeout_s):
            control.lease_incomplete(self, lease)
        if self.beat.due(now):
            self.heartbeat_all()
            if self.metrics is not None:
                self.metrics.publish(build_status(self))
        if self.progress.due(now):
            log_progress(self, now)
        self.ledger.maybe_flush(now)
        self.log_limit.report(now)
        if self.draining is None:
            control.check_end_of_stream(self)

    def _silent(self, now: float) -> list:
        """Live peers silent past --timeout-s. `now` may be seconds later than the poll that
        found the control socket empty (the loop stalled: descheduled on a loaded host, a
        slow disk): what the peers sent meanwhile is waiting there, so it is read first and
        a peer that kept talking is not dropped."""
        quiet = silent(self.peers.live(), now, self.cfg.timeout_s)
        if quiet and self.control.poll(RECHECK_MS):
            self._drain(self.control, lambda f: control.handle(self, f[0].bytes, f[1:]))
            quiet = silent(self.peers.live(), now, self.cfg.timeout_s)
        return quiet

    # ------------------------------------------------------------ sending

    def send(self, identity: bytes, type_: str, **fields) -> None:
        """Send a control message; a full or gone peer loses it (logged), we never block."""
        # welcome carries `run` as a field of its own; reject/status_reply carry none
        run = None if type_ in PRE_HANDSHAKE else self.run_id
        h = header(type_, run)
        h.update(fields)
        frames = [identity, *codec.encode(h)]
        try:
            send_frames(self.control, frames, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            ok, suppressed = self.log_limit.allow(f"send:{identity.hex()}")
            if ok:
                log.warning("broker.send_failed", identity=identity.hex(), type=type_, error=str(e),
                            suppressed=suppressed)

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
        stats.update(samples_total=s["total"], samples_done=s["done"], samples_skipped=s["skipped"],
                     n_samples=s["n_samples"], epoch=s["epoch"], epochs=s["epochs"])
        # The run's facts its first producer fixed: a consumer that joined before any producer
        # waits for the target layers here rather than guess them (PROTOCOL.md 4.2).
        stats["run_facts"] = {k: self.facts.get(k) for k in ("layer_ids", "hidden_size", "target_id")}
        for p in self.peers.live():
            self.send(p.identity, "heartbeat", stats=stats)

    def shutdown(self, reason: str) -> None:
        """SIGINT/SIGTERM: tell every live peer to stop, then drain (PROTOCOL.md 4.6).

        Consumers answer `stop {shutdown}` by finishing their step, writing a checkpoint
        and committing it: the broker must still be here to record that commit, or the
        samples trained since the last one are made and trained again after resume. So it
        keeps serving acks, commits and byes (sending no batch, granting no lease) until
        every peer has left or was lost, at most --drain-s; a second signal ends the wait."""
        self.stop_reason = "shutdown"
        self.stopping = {p.id for p in self.peers.live()}  # joiners are told to stop too
        self.draining = time.monotonic() + self.cfg.drain_s
        for p in self.peers.live():
            self.send(p.identity, "stop", reason="shutdown")
        self.ledger.flush()
        log.info("broker.draining", reason=reason, peers=sorted(self.stopping), drain_s=self.cfg.drain_s)
        self._reason = reason

    def _drained(self, now: float) -> bool:
        """End the loop once no peer told to stop is left (or the drain is over)."""
        left = sorted(pid for pid in self.stopping if pid in self.peers.by_id)
        if left and now < self.draining and self.signals < 2:
            return False
        self.ledger.flush()
        why = "drained" if not left else ("second signal" if self.signals >= 2 else "drain_s passed")
        log.info("broker.stop", reason=self._reason, outcome="interrupted", drain=why, peers_left=left,
                 **progress_fields(self, now))
        self.outcome = "interrupted"
        return True

    def close(self) -> None:
        """Release sockets and the ledger. Safe on a half-built broker."""
        for p in list(self.peers.live()):
            p.close_pipes()
        if getattr(self, "control", None) is not None:
            self.control.close(linger=1000)  # let the last stop/replies out
        if getattr(self, "data_in", None) is not None:
            self.data_in.close(linger=0)
        if getattr(self, "auth", None) is not None:
            self.auth.stop()  # after the sockets: none may outlive the authenticator
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        if getattr(self, "lighthouse", None) is not None:
            self.lighthouse.close()
        self.ctx.term()
        self.ledger.close()
