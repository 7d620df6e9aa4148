"""The client side of the protocol, shared by producers and consumers.

`PeerLink` owns every socket of a peer in one background I/O thread (ZeroMQ sockets are
not thread-safe, and the GPU loop must never wait on the network). The training or
capture loop talks to it through bounded queues:

- producers: `request_lease()`, `push_batch()` (blocks while the outbox is full: that is
  the backpressure from the broker), `lease_done()`;
- consumers: `next_batch()` (credit is granted for free room in the inbox: credit.py),
  `ack()`, `commit()`, and `stopped` once the broker signals end of stream.

Failures surface as exceptions on the next call: `BrokerUnreachable` (no handshake),
`Rejected` (the broker refused us), `BrokerLost` (silent past the timeout).
"""

from __future__ import annotations

import itertools
import os
import queue
import secrets
import socket as _socket
import sys
import threading
import time
from typing import Any, Callable

import zmq

from dflash.runtime.gcpause import freeze_setup
from dflash.runtime.logs import bind_run, close_logging, get_logger
from dflash.runtime.threads import name_this_thread

from . import codec
from .credit import CreditWindow
from .curve import CurveClient
from .errors import BrokerUnreachable, DFlashError, MessageTooLarge, ProtocolError, Rejected, RunMismatch
from .messages import (CONTROL_FROM_BROKER, CONTROL_MAX_BYTES, DATA, MAX_HEADER_BYTES, Ack, Batch, Bye, Commit, Credit,
                       Done, Heartbeat, Hello, LeaseAsk, Message)
from .sockets import (AUTO_DATA_STREAMS, SocketOpts, auto_io_threads, first_thread, make_socket, nth_other_thread,
                      other_threads, readable, recv_frames, send_frames)

log = get_logger()

MAX_AUTO_CREDIT = 16  # the deepest inbox small batches get (credit.py); the broker caps at max_credit


class BrokerLost(DFlashError):
    """The broker went silent for longer than the liveness timeout."""


# How long a peer that seems to have heard nothing for `timeout_s` looks at the control
# socket once more before calling the broker lost (broker_silent).
RECHECK_MS = 100


def broker_silent(ctl: zmq.Socket, now: float, last_rx: float, timeout_s: float, recheck_ms: int = RECHECK_MS) -> bool:
    """True when nothing came from the broker for `timeout_s` and nothing is waiting on `ctl`
    either. The poll that found `ctl` empty may be seconds older than `now`: the I/O thread
    was descheduled, or waited for the GIL the training thread held, on a loaded host. A
    broker that kept sending meanwhile has messages waiting: it is not lost."""
    return now - last_rx > timeout_s and not ctl.poll(recheck_ms, zmq.POLLIN)


# After the broker is lost, how long the process's own thread gets to notice (on its next
# call into the link) and exit by itself before exit_when_stuck ends it.
LOST_GRACE_S = 1.0


def exit_when_stuck(role: str, grace_s: float = LOST_GRACE_S) -> Callable[[Exception], None]:
    """A PeerLink `on_lost`: if the process is still running `grace_s` after the broker was
    lost (its main thread blocked elsewhere: an elastic consumer in a torchft quorum with the
    broker's lighthouse gone, a producer in a long forward), log `event` with the error,
    write the one `error:` line on stderr and exit 1. PROTOCOL.md 4.2: a peer that finds the
    broker silent for `timeout_s` exits, and says why as its last word. `role`: producer or
    consumer (the event is `produce.broker_lost` or `consume.broker_lost`)."""
    def on_lost(error: Exception) -> None:
        def later() -> None:
            time.sleep(grace_s)
            try:  # (no import here: this may run while the interpreter shuts down)
                if role == "consumer":
                    log.error("consume.broker_lost", error=str(error), error_type=type(error).__name__, stuck=True)
                else:
                    log.error("produce.broker_lost", error=str(error), error_type=type(error).__name__, stuck=True)
            finally:
                exit_broker_lost(error)

        threading.Thread(target=later, name="dflash-broker-lost", daemon=True).start()

    return on_lost


def exit_broker_lost(error: Exception) -> None:
    """Exit 1 now, `error:` and the reason as the last line on stderr, logs flushed: after
    the broker is lost nothing is left to hand back, and the interpreter's own teardown
    (library threads and exit handlers) took seconds beyond --timeout-s."""
    try:
        close_logging()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os.write(2, f"error: {error}\n".encode())
        os._exit(1)


class PeerLink:
    def __init__(
        self,
        broker: str,
        role: str,
        instance: str,
        *,
        gpu: int | None = None,
        config: dict | None = None,
        run: str | None = None,
        runs_dir=None,
        connect_timeout_s: float = 30.0,
        outbox_batches: int = 2,
        inbox_batches: int = 2,
        inbox_bytes: int | None = None,
        stats: Callable[[], dict] | None = None,
        max_message_bytes: int = 1 << 30,
        curve: CurveClient | None = None,
        io_threads: int = 0,
        on_lost: Callable[[Exception], None] | None = None,
    ):
        if role not in ("producer", "consumer"):
            raise ValueError(f"role must be producer or consumer, not {role!r}")
        self.broker, self.role, self.instance, self.gpu = broker, role, instance, gpu
        self.config, self.expect_run, self.runs_dir = config or {}, run, runs_dir
        self.connect_timeout_s = connect_timeout_s
        self.stats = stats or (lambda: {})
        self.max_message_bytes = max_message_bytes
        self.curve = curve  # CurveZMQ client keys (protocol/curve.py), or None for plain TCP
        self.welcome: dict = {}
        self.broker_stats: dict = {}
        self.stopped = threading.Event()
        self.stop_reason: str | None = None  # the `stop`'s reason: end_of_stream or shutdown
        self.error: Exception | None = None
        self.on_lost = on_lost  # called on the I/O thread once the broker is lost (exit_when_stuck)
        # ZeroMQ I/O threads of this link's own context (0 = auto, where cores are to spare:
        # control on one, and one per data connection, AUTO_DATA_STREAMS: the most a broker
        # opens by itself).
        self._io_threads = io_threads or auto_io_threads(AUTO_DATA_STREAMS)
        self._ctx: zmq.Context | None = None  # made in start(), ended in close()
        self._control_out: queue.Queue = queue.Queue()  # small messages; never blocks callers
        self._outbox: queue.Queue = queue.Queue(maxsize=max(1, outbox_batches))
        self._inbox: queue.Queue = queue.Queue()  # bounded by the credit we grant
        # Sized once the welcome says the broker's max_credit (start); None for producers.
        self._inbox_bounds = (inbox_batches, inbox_bytes)
        self._credit: CreditWindow | None = None
        self._grants: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._seq = itertools.count()
        self._pending_batch: list | None = None  # frames a full PUSH pipe refused, sent next turn
        self._in_flight = 0  # batches handed to us and not yet given to ZeroMQ
        self.routing_id = f"{role}/{os.getpid()}/{secrets.token_hex(4)}/{instance}".encode()[:255]

    # ------------------------------------------------------------ lifecycle

    @property
    def run_id(self) -> str:
        return self.welcome["run"]

    @property
    def peer_id(self) -> str:
        return self.welcome["peer"]

    def start(self) -> dict:
        """Handshake, then start the I/O thread. Returns the welcome header.

        Raises BrokerUnreachable, Rejected (RunMismatch for another run's ID)."""
        self._ctx = zmq.Context(io_threads=self._io_threads)
        # A routing ID of our own: when ZeroMQ closes and reopens the control connection (a
        # network reset), the broker's ROUTER knows it by the same identity, so the session
        # goes on; without one it gets a new identity and every later message is refused
        # `unknown_peer` (a message sent meanwhile would be lost). Unique per link.
        ctl = make_socket(self._ctx, zmq.DEALER, self.broker, bind=False, identity=self.routing_id,
                          opts=SocketOpts(maxmsgsize=CONTROL_MAX_BYTES, curve=self.curve,
                                          affinity=first_thread(self._io_threads)))
        try:
            self.welcome = self._handshake(ctl)
        except Exception:
            ctl.close(linger=0)
            self._ctx.term()
            raise
        self._ctl = ctl
        path = bind_run(self.run_id, self.runs_dir)
        log.info("link.welcome", broker=self.broker, peer=self.peer_id, log_file=str(path),
                 run_config=self.welcome.get("run_config"))
        if self.role == "consumer":  # the I/O thread grants the first credit on its first turn
            most = min(MAX_AUTO_CREDIT, int(self.welcome.get("max_credit") or MAX_AUTO_CREDIT))
            self._credit = CreditWindow(self._inbox_bounds[0], self._inbox_bounds[1], max_batches=most)
            self._wake()  # so the I/O thread's first poll returns at once and grants it
        self._streams = self._open_data_sockets()
        self._data = self._streams[0]
        self.stream_batches = [0] * len(self._streams)  # batches received on each data stream
        self._thread = threading.Thread(target=self._io_loop, name=f"dflash-io-{self.role}", daemon=True)
        freeze_setup()  # the process's imports and setup: no full GC pass over them (gcpause.py)
        self._thread.start()
        return self.welcome

    def _handshake(self, ctl) -> dict:
        hello = Hello(self.role, self.instance, _socket.gethostname(), os.getpid(), gpu=self.gpu,
                      run=self.expect_run or None, config=self.config)
        log.info("link.connect", broker=self.broker, expect_run=self.expect_run)
        codec.send(ctl, hello.to_header())
        if not ctl.poll(int(self.connect_timeout_s * 1000)):
            # With Curve a refused key looks exactly like this: the broker says nothing.
            hint = (f" (CurveZMQ on: is key {self.curve.name!r} in the broker's authorized/ folder?)"
                    if self.curve else "")
            raise BrokerUnreachable(f"no answer from broker {self.broker} within {self.connect_timeout_s:g}s{hint}")
        msg = codec.recv(ctl, allowed=CONTROL_FROM_BROKER, peer="broker")
        if msg.type == "reject":
            cls = RunMismatch if msg.header["code"] == "run_mismatch" else Rejected
            log.error("link.rejected", reason=msg.header["reason"], code=msg.header["code"])
            raise cls(msg.header["reason"], msg.header["code"])
        if msg.type != "welcome":
            raise ProtocolError(f"expected welcome, got {msg.type}", peer="broker")
        return msg.header

    def _open_data_sockets(self) -> list:
        if self.role == "producer":
            # A tiny send HWM: memory stays bounded and backpressure reaches the producer
            # as soon as the broker stops reading. One PUSH, connected once per data stream
            # the broker asks for (the same endpoint again: a TCP connection each, which
            # libzmq puts on the least busy I/O thread of the mask); batches take them in turn.
            endpoints = self.welcome.get("data_streams") or [self.welcome["data_in"]]
            sock = make_socket(self._ctx, zmq.PUSH, endpoints[0], bind=False,
                               opts=SocketOpts(sndhwm=1, linger_ms=-1, curve=self.curve,
                                               affinity=other_threads(self._io_threads)))
            for endpoint in endpoints[1:]:
                sock.connect(endpoint)
            return [sock]
        # One PULL per data stream the broker opened for us (PROTOCOL.md 4.1), each on an
        # I/O thread of its own while there are threads; a broker that names none has one.
        endpoints = self.welcome.get("data_streams") or [self.welcome["data_out"]]
        socks = []
        try:
            for i, endpoint in enumerate(endpoints):
                socks.append(make_socket(
                    self._ctx, zmq.PULL, endpoint, bind=False,
                    opts=SocketOpts(rcvhwm=self._credit.max_batches + 1, maxmsgsize=self.max_message_bytes,
                                    curve=self.curve, affinity=nth_other_thread(self._io_threads, i))))
        except Exception:
            for sock in socks:
                sock.close(linger=0)
            raise
        return socks

    def close(self, reason: str = "done", flush_timeout_s: float = 60.0) -> None:
        """Flush queued batches (producers), say `bye`, stop the I/O thread, close sockets."""
        if self._thread is None:
            return
        deadline = time.monotonic() + flush_timeout_s
        while self.role == "producer" and self.error is None and time.monotonic() < deadline:
            if self._outbox.empty() and self._pending_batch is None:
                break
            time.sleep(0.01)
        self._closing.set()
        self._wake()
        self._thread.join(timeout=flush_timeout_s)
        if self.error is None and not self._thread.is_alive():
            # The thread may have left its loop before sending what was queued just
            # before close (a last ack or commit): the socket is ours now, send it.
            self._flush_control()
        self._thread = None
        # Producers: deliver what ZeroMQ still holds before saying bye, so the broker does
        # not return leases whose batches are merely in transit.
        # (after a failure nothing waits: the broker is gone or refused us, and term would wait)
        linger = int(flush_timeout_s * 1000) if self.role == "producer" and self.error is None else 0
        for sock in self._streams:
            sock.close(linger=linger)
        if self.error is None:
            try:
                codec.send(self._ctl, Bye(reason).to_header(self.run_id), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._ctl.close(linger=1000 if self.error is None else 0)
        self._ctx.term()  # returns once the bye (and a producer's last batches) left, or linger ran out
        os.close(self._wake_r)
        os.close(self._wake_w)
        log.info("link.closed", reason=reason)

    # ------------------------------------------------------------ caller API

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def send_control(self, msg: Message) -> None:
        """Queue a control message. Raises MessageTooLarge for one over the control limit:
        refused here, since the broker's ZeroMQ would close the connection and drop it."""
        self._check()
        h = msg.to_header(self.run_id)
        n = len(codec.encode(h)[0])
        if n > MAX_HEADER_BYTES:
            raise MessageTooLarge(f"control message {msg.type!r} is {n} bytes, over the control limit of "
                                  f"{MAX_HEADER_BYTES} bytes (PROTOCOL.md 3): not sent")
        self._control_out.put(h)
        self._wake()

    def request_lease(self, want: int, timeout_s: float | None = None) -> dict:
        """Ask for up to `want` samples; returns the `grant` header (may be empty, see `end`)."""
        self.send_control(LeaseAsk(want))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._check()
            try:
                return self._grants.get(timeout=0.1)
            except queue.Empty:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"no grant from the broker within {timeout_s}s") from None

    def push_batch(self, fields: dict, tensors: dict, timeout_s: float | None = None) -> str:
        """Queue one batch for the broker (`fields`: Batch's but its ID and producer); blocks
        while the outbox is full. Returns its ID."""
        batch_id = f"{self.peer_id}-{next(self._seq)}"
        h = Batch(batch_id=batch_id, producer=self.peer_id, **fields).to_header(self.run_id)
        frames = codec.encode(h, tensors)
        self._check_size(batch_id, frames)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._check()
            try:
                self._outbox.put(frames, timeout=0.1)
                self._wake()
                return batch_id
            except queue.Full:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError("outbox still full: the broker is not reading") from None

    def _check_size(self, batch_id: str, frames: list) -> None:
        """Refuse a batch over the broker's limits (its welcome's `max_message_bytes`) before
        it leaves: sent, it would be dropped or refused at the broker, its samples lost."""
        limit = int((self.welcome.get("run_config") or {}).get("max_message_bytes") or self.max_message_bytes)
        payload = codec.payload_bytes(frames)
        if len(frames[0]) > MAX_HEADER_BYTES or payload > limit:
            raise MessageTooLarge(
                f"batch {batch_id} is {payload} tensor bytes (header {len(frames[0])}), over the broker's "
                f"limit of {limit} bytes per message (header {MAX_HEADER_BYTES}): not sent; lower "
                "--token-budget or --max-batch-size, or raise the broker's --max-message-bytes")

    def lease_done(self, lease: int, skipped: list) -> None:
        self.send_control(Done(lease, [[int(s), str(r)] for s, r in skipped]))

    def next_batch(self, timeout_s: float | None = None) -> codec.Message | None:
        """The next batch, or None on timeout or once stopped and drained. Grants credit."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._check()
            try:
                frames = self._inbox.get(timeout=0.05)
            except queue.Empty:
                if self.stopped.is_set() and self._inbox.empty():
                    return None
                if deadline is not None and time.monotonic() > deadline:
                    return None
                continue
            if self._credit.would_grant(self._inbox.qsize()):
                self._wake()  # room for a lump of credit: the I/O thread grants it now
            # Decoded here, in the caller's thread, not on the I/O thread: at thousands of
            # small batches a second that thread was a relay's busiest (0.84 core).
            try:
                return codec.decode(frames, allowed=DATA, run=self.run_id, peer="broker")
            except ProtocolError as e:
                log.error("link.bad_message", reason=e.reason, peer="broker")

    # (no lineage, or "", is sent as none: the broker's default lineage)
    def ack(self, batch_ids: list[str], step: int, lineage: str | None = None) -> None:
        self.send_control(Ack(list(batch_ids), int(step), lineage or None))

    def commit(self, step: int, checkpoint: str, lineage: str | None = None) -> None:
        self.send_control(Commit(int(step), str(checkpoint), lineage or None))

    def prefetched(self) -> int:
        return self._inbox.qsize() if self.role == "consumer" else self._outbox.qsize()

    # ------------------------------------------------------------ I/O thread

    def _io_loop(self) -> None:
        name_this_thread(f"dflash-io-{self.role[:4]}")
        hb = float(self.welcome["heartbeat_s"])
        timeout = float(self.welcome["timeout_s"])
        last_rx = last_tx = time.monotonic()
        poller = zmq.Poller()
        poller.register(self._ctl, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if self.role == "consumer":
            for sock in self._streams:
                poller.register(sock, zmq.POLLIN)
        try:
            while not self._closing.is_set():
                if self.role == "producer":
                    # A batch the full pipe refused: wake the moment the pipe has room again,
                    # not at the next heartbeat tick (that capped a producer at ~4 batches/s).
                    poller.modify(self._data, zmq.POLLOUT if self._pending_batch is not None else 0)
                events = dict(poller.poll(timeout=int(hb * 250)))
                now = time.monotonic()
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                if self._ctl in events:
                    while readable(self._ctl):
                        self._on_control(codec.recv(self._ctl, allowed=CONTROL_FROM_BROKER,
                                                    run=self.run_id, peer="broker"))
                    last_rx = now
                if self.role == "consumer":
                    for i, sock in enumerate(self._streams):
                        if sock in events:
                            self._drain_data(i)
                    self._grant_credit()
                self._flush_control()
                if self.role == "producer":
                    self._flush_batches()
                if now - last_tx >= hb:
                    self._send_heartbeat()
                    last_tx = now
                if broker_silent(self._ctl, now, last_rx, timeout):
                    raise BrokerLost(f"broker {self.broker} silent for {now - last_rx:.1f}s "
                                     f"(timeout {timeout:g}s): broker lost")
        except Rejected as e:
            self.error = e
        except Exception as e:  # surfaced to the caller on its next call
            log.error("link.failed", error=f"{type(e).__name__}: {e}")
            self.error = e
            if isinstance(e, BrokerLost) and self.on_lost is not None:
                self.on_lost(e)

    def _on_control(self, msg: codec.Message) -> None:
        h = msg.header
        if h["type"] == "heartbeat":
            self.broker_stats = h["stats"]
        elif h["type"] == "grant":
            self._grants.put(h)
        elif h["type"] == "stop":
            log.info("link.stop", reason=h["reason"])
            self.stop_reason = str(h["reason"])  # set before the event: readers see both
            self.stopped.set()
        elif h["type"] == "reject":
            log.error("link.rejected", reason=h["reason"], code=h["code"])
            raise Rejected(h["reason"], h["code"])

    def _drain_data(self, stream: int) -> None:
        sock = self._streams[stream]
        while readable(sock):
            frames = recv_frames(sock, zmq.NOBLOCK)
            self.stream_batches[stream] += 1
            self._credit.arrived(sum(len(f) for f in frames))
            self._inbox.put(frames)  # validated and decoded by next_batch

    def _grant_credit(self) -> None:
        n = self._credit.to_grant(self._inbox.qsize())
        if n:
            codec.send(self._ctl, Credit(n).to_header(self.run_id))

    def _flush_control(self) -> None:
        while True:
            try:
                h = self._control_out.get_nowait()
            except queue.Empty:
                return
            codec.send(self._ctl, h)

    def _flush_batches(self) -> None:
        while True:
            if self._pending_batch is None:
                try:
                    self._pending_batch = self._outbox.get_nowait()
                except queue.Empty:
                    return
            try:
                send_frames(self._data, self._pending_batch, zmq.NOBLOCK)
            except zmq.Again:
                return  # the broker is not reading: keep it, heartbeats go on meanwhile
            self._pending_batch = None

    def _send_heartbeat(self) -> None:
        try:
            stats: dict[str, Any] = dict(self.stats())
        except Exception as e:  # a broken stats callback must not kill liveness
            stats = {"stats_error": repr(e)}
        codec.send(self._ctl, Heartbeat(stats).to_header(self.run_id))
