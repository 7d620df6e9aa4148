"""The broker's sockets and loop: BrokerCore (core.py) decides, this module does.

    control  ROUTER  <- hello/lease/done/credit/ack/commit/heartbeat/bye/status
    data in  PULL    <- batches from producers (read only while the queue has room)
    data out PUSH x consumers -> one pipe each, sent only against that consumer's credit

It alone owns every socket and every held batch's frames; one thread, so nothing is locked, and
every send is NOBLOCK so a slow or dead peer never stalls the loop.
"""

from __future__ import annotations

import time

import zmq

from dflash.protocol import codec, curve
from dflash.protocol.errors import ProtocolError
from dflash.protocol.messages import CONTROL_TO_BROKER, PRE_HANDSHAKE, Ack, Bye, Commit, Credit, Done, Failed, Release, Heartbeat, Hello, LeaseAsk, LineageStart, StatusAsk
from dflash.protocol.fields import Message
from dflash.protocol.sockets import SocketOpts, first_thread, make_socket, readable, recv_frames, send_frames, tcp_endpoint
from dflash.runtime.gcpause import freeze_setup
from dflash.runtime.logs import get_logger, run_file_error
from dflash.runtime.run import StorageError

from . import lighthouse, monitor, security
from .actions import ClosePipes, DropFrames, OpenPipes, Publish, Send
from .config import CONTROL_RCVHWM, CONTROL_SNDHWM, DATA_IN_RCVHWM, MAX_CREDIT, BrokerConfig, data_in_frame_cap
from dflash.protocol.messages import CONTROL_MAX_BYTES
from .core import BrokerCore
from .inbound import Arrival, BadBatch, Unreadable, connection, control_message
from .metrics import MetricsServer
from .replies import LogGate
from .resume import Parent

log = get_logger()

POLL_MS = 100  # longest the loop sleeps: timers (heartbeats, expiry) run at this grain
BLOCKED_POLL_MS = 5  # a batch waits on a pipe that is not connected yet: look again soon
DRAIN_MAX = 256  # messages read per socket per turn, so one busy socket cannot starve the other
RECHECK_MS = 50  # before dropping a silent peer, how long to wait for what is on its way


class Broker:
    def __init__(self, cfg: BrokerConfig, run_id: str, run_dir, hostname: str, parent: Parent | None = None):
        """Bind the control and data-in sockets; raises zmq.ZMQError (a port in use) or CurveKeyError."""
        self.cfg = cfg
        self.io_threads = cfg.io_thread_count()
        self.streams = cfg.stream_count(bin(self.out_affinity).count("1"))
        self.producer_streams = cfg.stream_count(bin(self.in_affinity).count("1"))
        self.signal: str | None = None  # set by the signal handler, handed to the core by the loop
        self.signals = 0  # SIGINT/SIGTERM received
        self.curve = self.auth = self.control = self.data_in = self.metrics = self.lighthouse = None
        self.ctx = None
        self.monitors: dict = {}  # monitor socket -> (the socket it watches, its name): handshake failures
        # consumers' PUSH sockets by port, and each held batch's frames by ID: the core only names them
        self.pipes: dict[int, zmq.Socket] = {}
        self.frames: dict[str, list] = {}
        self.handshakes = monitor.HandshakeLog(curve=bool(cfg.curve_keys))
        self.send_gate = LogGate(time.monotonic())  # broker.send_failed lines, rate-limited
        # the core first: a resume's inherited rows are on disk before any socket exists
        self.core = BrokerCore(cfg, run_id, run_dir, hostname, now=time.monotonic(), wall=time.time(), parent=parent,
                               pipe_threads=self.pipe_threads, streams=self.streams,
                               producer_streams=self.producer_streams)
        self.ctx = zmq.Context(io_threads=self.io_threads)
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
            for sock, name in ((self.control, "control"), (self.data_in, "data_in")):
                self.monitors[monitor.watch(sock)] = (sock, name)
            if cfg.metrics_port:  # bound with the sockets: a port in use stops the start
                self.metrics = MetricsServer(cfg.bind, cfg.metrics_port)
            if cfg.elastic and cfg.consumers >= 2:  # consumers meet there every step
                self.lighthouse = lighthouse.start(cfg.bind, cfg.lighthouse_port, cfg.host_to_advertise(hostname),
                                                   cfg.timeout_s)
                self.core.use_lighthouse(self.lighthouse.address if self.lighthouse is not None else None)
        except Exception:
            self.close()
            raise

    # What callers (broker_process.py, tests) read of the run: the core's.
    run_id = property(lambda self: self.core.run_id)
    run_dir = property(lambda self: self.core.run_dir)
    endpoints = property(lambda self: self.core.endpoints)
    outcome_why = property(lambda self: self.core.outcome_why)

    # I/O threads by role (ZMQ_AFFINITY masks): with two, control and batches in share the first;
    # from three, control has the first alone, batches in the next (n-1)//2, pipes the rest.

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

    # ------------------------------------------------------------ the loop

    def serve(self) -> str:
        """Run until end of stream or a signal; returns the outcome for run.json."""
        freeze_setup()  # imports and setup: a full GC pass would stall the loop (runtime/gcpause.py)
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.data_in, zmq.POLLIN)
        for mon in self.monitors:
            poller.register(mon, zmq.POLLIN)
        core = self.core
        while not core.done:
            # backpressure: a full broker stops reading, so the producers' sends block
            poller.modify(self.data_in, zmq.POLLIN if core.reading else 0)
            events = dict(poller.poll(BLOCKED_POLL_MS if core.blocked else POLL_MS))
            if self.control in events:
                self._drain(self.control, self._control)
            if self.data_in in events:
                self._drain(self.data_in, self._data, while_room=True)
            for mon, (_, name) in self.monitors.items():
                if mon in events:
                    self.handshakes.read(mon, name)
            self._dispatch(time.monotonic())
            if self.signal is not None:
                core.on_signal(self.signal, self.signals)
            self.tick(time.monotonic())
            if (why := run_file_error()) is not None:  # its log is the run's record: not gone on without
                raise StorageError(why)
        core.report(time.monotonic())  # no suppressed count goes unsaid
        self.handshakes.report(time.monotonic(), force=True)
        self.send_gate.report(time.monotonic(), force=True)
        return core.outcome

    def tick(self, now: float) -> None:
        """The core's timers; after a stalled loop, what peers sent meanwhile is read first so a peer
        that kept talking is not dropped as silent."""
        core = self.core
        if core.silent(now) and self.control.poll(RECHECK_MS):
            self._drain(self.control, self._control)
        self.do(core.tick(now))
        self.handshakes.report(now)
        self.send_gate.report(now)

    def _drain(self, sock: zmq.Socket, handle, while_room: bool = False) -> None:
        for _ in range(DRAIN_MAX):
            if while_room and not self.core.reading:
                return
            try:
                frames = recv_frames(sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                handle(frames)
            except StorageError:  # the disk refused a write: no message can be handled right
                raise
            except Exception:  # a bug on one message must not end the run
                log.exception("broker.internal_error", socket="control" if sock is self.control else "data_in")
            if not readable(sock):  # cheaper than the zmq.Again a last recv would raise
                return

    def _control(self, frames: list) -> None:
        """One control message, typed (or why it is refused), to the core's entry point for its type."""
        identity, frames, now = frames[0].bytes, frames[1:], time.monotonic()
        try:
            if not frames:
                raise ProtocolError("empty message")
            h = codec.unpack_header(frames[0])
        except ProtocolError as e:
            return self.do(self.core.on_unreadable(identity, Unreadable("bad_message", e.reason), now))
        error = None
        try:
            # checked, never read: no tensor views (a control message with tensors would import torch)
            codec.decode(frames, allowed=CONTROL_TO_BROKER, run=self.core.run_id, parsed=h, views=False)
        except ProtocolError as e:
            error = e.reason
        msg = control_message(h, error, self.core.run_id)
        self.do(self._deliver(identity, msg, now, frames[0]))

    def _deliver(self, identity: bytes, msg: Message | Unreadable, now: float, header_frame=None) -> list:
        """The core's entry point for `msg`'s type; a hello's `header_frame` names its Curve key."""
        core = self.core
        match msg:
            case Unreadable():
                return core.on_unreadable(identity, msg, now)
            case StatusAsk():
                return core.on_status(identity, msg, now)
            case Hello():
                key = curve.key_name(header_frame) if header_frame is not None else None
                return core.on_hello(identity, msg, now, key)
            case LeaseAsk():
                return core.on_lease(identity, msg, now)
            case Done():
                return core.on_done(identity, msg, now)
            case Release():
                return core.on_release(identity, msg, now)
            case Credit():
                return core.on_credit(identity, msg, now)
            case Ack():
                return core.on_ack(identity, msg, now)
            case Commit():
                return core.on_commit(identity, msg, now)
            case LineageStart():
                return core.on_lineage(identity, msg, now)
            case Heartbeat():
                return core.on_heartbeat(identity, msg, now)
            case Bye():
                return core.on_bye(identity, msg, now)
            case Failed():
                return core.on_failed(identity, msg, now)
        raise TypeError(f"no broker entry point for {msg!r}")

    def _data(self, frames: list) -> None:
        now = time.monotonic()
        try:
            header = codec.unpack_header(frames[0]) if frames else None
            batch = codec.decode_batch(frames, run=self.core.run_id, views=False, parsed=header)  # relayed, never read
        except ProtocolError as e:
            bad = BadBatch(sender(frames), e.reason, connection(frames[0]) if frames else {})
            return self.do(self.core.on_bad_batch(bad, now))
        arrival = Arrival.read(batch, header, frames)
        batch_id = arrival.batch.batch_id
        try:
            self.do(self.core.on_batch(arrival, now))
        finally:  # queued (even by an entry that then raised): its frames are kept for the relay
            if batch_id not in self.frames and self.core.holds(batch_id):
                self.frames[batch_id] = frames

    def _dispatch(self, now: float) -> None:
        """Relay the batches the core picks, each on the first of its consumer's pipes that takes it."""
        core = self.core
        relay = core.dispatch(now)
        while relay is not None:
            took = send_first([(port, self.pipes[port]) for port in relay.ports], self.frames[relay.batch_id])
            relay = core.relayed(relay, took, now)

    def _bind_pipe(self, port: int, thread: int):
        """A consumer's data-out PUSH on `port`, on I/O thread `thread`; None if the port is taken."""
        try:
            return make_socket(self.ctx, zmq.PUSH, tcp_endpoint(self.cfg.bind, port), bind=True,
                               opts=SocketOpts(sndhwm=MAX_CREDIT + 1, linger_ms=0, curve=self.curve, affinity=thread))
        except zmq.ZMQError:
            return None  # another process holds it

    # ------------------------------------------------------------ the core's actions

    def do(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Send):
                self.send(a.identity, a.msg)
            elif isinstance(a, OpenPipes):
                self.do(self.core.on_pipes(a, self._open_pipes(a)))
            elif isinstance(a, ClosePipes):
                for port in a.ports:
                    if (sock := self.pipes.pop(port, None)) is not None:
                        sock.close(linger=0)
            elif isinstance(a, DropFrames):
                for batch_id in a.batch_ids:
                    self.frames.pop(batch_id, None)
            elif isinstance(a, Publish):
                if self.metrics is not None:
                    self.metrics.publish(a.status)
            else:
                raise TypeError(f"unknown broker action {a!r}")

    def _open_pipes(self, a: OpenPipes) -> list[int]:
        """Bind the pipes `a` asks for: the ports that bound, in order."""
        bound: list[int] = []
        for port in a.ports:
            if len(bound) == len(a.threads):
                break
            sock = self._bind_pipe(port, a.threads[len(bound)])
            if sock is not None:
                self.pipes[port] = sock
                bound.append(port)
        return bound

    def send(self, identity: bytes, msg: Message) -> None:
        """Send a control message; a full or gone peer loses it (logged), we never block."""
        run = None if msg.type in PRE_HANDSHAKE else self.core.run_id
        frames = [identity, *codec.encode(msg.to_header(run))]
        try:
            send_frames(self.control, frames, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            ok, suppressed = self.send_gate.allow(f"send:{identity.hex()}", time.monotonic())
            if ok:
                log.warning("broker.send_failed", identity=identity.hex(), type=msg.type, error=str(e),
                            suppressed=suppressed)

    def close(self) -> None:
        """Release sockets and the ledger. Safe on a half-built broker."""
        self.do(self.core.close())  # the consumers' pipes, before the context ends
        for sock in self.pipes.values():  # any the core did not name (a half-built broker)
            sock.close(linger=0)
        self.pipes.clear()
        for mon, (sock, _) in self.monitors.items():
            sock.disable_monitor()
            mon.close(linger=0)
        if self.control is not None:
            self.control.close(linger=1000)  # let the last stop/replies out
        if self.data_in is not None:
            self.data_in.close(linger=0)
        if self.auth is not None:
            self.auth.stop()  # after the sockets: none may outlive the authenticator
        if self.metrics is not None:
            self.metrics.close()
        if self.lighthouse is not None:
            self.lighthouse.close()
        self.frames.clear()
        if self.ctx is not None:
            self.ctx.term()


def send_first(pipes: list[tuple[int, zmq.Socket]], frames: list) -> int | None:
    """Send `frames` on the first of `pipes` that takes them now: its port, or None (stays queued)."""
    for port, sock in pipes:
        try:
            send_frames(sock, frames, zmq.NOBLOCK)
        except zmq.Again:  # not connected (yet), or full: try the next stream
            continue
        return port
    return None


def sender(frames: list) -> str:
    """Who sent this data message, for log lines: its `producer` field, else the connection's peer ID,
    else its TCP address."""
    try:
        prod = codec.unpack_header(frames[0]).get("producer")
        if isinstance(prod, str) and prod:
            return prod[:64]
    except (ProtocolError, IndexError):
        pass
    conn = connection(frames[0]) if frames else {}
    if conn.get("peer"):
        return conn["peer"][:64]
    return f"addr:{conn.get('address', 'unknown')}"
