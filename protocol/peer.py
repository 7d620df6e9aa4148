"""The client side of the protocol: what a producer's and a consumer's link share.

`PeerLink` owns every socket of a peer in one background I/O thread (ZeroMQ sockets are not
thread-safe, and the GPU loop must never wait on the network); links.py adds each role's data side.
Failures surface as exceptions on the next call (`BrokerUnreachable`, `Rejected`, `BrokerLost`).
"""

from __future__ import annotations

import os
import queue
import secrets
import socket as _socket
import sys
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Callable

import zmq

from dflash.runtime.gcpause import freeze_setup
from dflash.runtime.logs import bind_run, close_logging, get_logger
from dflash.runtime.threads import name_this_thread

from . import codec
from .curve import CurveClient
from .errors import BrokerUnreachable, DFlashError, MessageTooLarge, ProtocolError, Rejected, RunMismatch
from .messages import CONTROL_FROM_BROKER, CONTROL_MAX_BYTES, MAX_HEADER_BYTES, Bye, Heartbeat, Hello, Reject, Stop, Welcome
from dflash.protocol.fields import Message
from .sockets import AUTO_DATA_STREAMS, SocketOpts, auto_io_threads, first_thread, make_socket, readable

log = get_logger()


class BrokerLost(DFlashError):
    """The broker went silent for longer than the liveness timeout."""


RECHECK_MS = 100


def broker_silent(ctl: zmq.Socket, now: float, last_rx: float, timeout_s: float, recheck_ms: int = RECHECK_MS) -> bool:
    """True when nothing came from the broker for `timeout_s` and nothing waits on `ctl` either: the
    last poll may be seconds old (a descheduled thread, the GIL), and a broker that kept sending is not lost."""
    return now - last_rx > timeout_s and not ctl.poll(recheck_ms, zmq.POLLIN)


# After the broker is lost, how long the main thread gets to notice and exit before exit_when_stuck does.
LOST_GRACE_S = 1.0


def exit_when_stuck(role: str, grace_s: float = LOST_GRACE_S) -> Callable[[Exception], None]:
    """A link's `on_lost`: if the process still runs `grace_s` after the broker was lost (its main thread
    blocked elsewhere), log `<role>.broker_lost` and exit 1 saying why (PROTOCOL.md 4.2)."""
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
    """Exit 1 now with `error:` as the last stderr line, logs flushed: the interpreter's teardown took
    seconds, and with the broker lost nothing is left to hand back."""
    try:
        close_logging()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os.write(2, f"error: {error}\n".encode())
        os._exit(1)


class PeerLink(ABC):
    """A link to the broker on an I/O thread of its own; subclasses set `role`, open their data sockets
    (`_open_data`) and do their share of each I/O turn (`_turn`)."""

    role: str  # "producer" or "consumer": set by each subclass

    def __init__(
        self,
        broker: str,
        instance: str,
        *,
        gpu: int | None = None,
        config: dict | None = None,
        run: str | None = None,
        runs_dir=None,
        connect_timeout_s: float = 30.0,
        stats: Callable[[], dict] | None = None,
        max_message_bytes: int = 1 << 30,
        curve: CurveClient | None = None,
        io_threads: int = 0,
        on_lost: Callable[[Exception], None] | None = None,
    ):
        self.broker, self.instance, self.gpu = broker, instance, gpu
        self.config, self.expect_run, self.runs_dir = config or {}, run, runs_dir
        self.connect_timeout_s = connect_timeout_s
        self.stats = stats or (lambda: {})
        self.max_message_bytes = max_message_bytes
        self.curve = curve  # CurveZMQ client keys (protocol/curve.py), or None for plain TCP
        self.welcome: Welcome | None = None  # the broker's, once start() returned
        self.broker_stats: dict = {}
        self.broker_plan: int | None = None  # the heartbeat's planned_samples (the lr schedule's length)
        self.broker_progress: float | None = None  # its budget_progress (--time-budget: the lr schedule's)
        self.stopped = threading.Event()
        self.stop_reason: str | None = None  # the `stop`'s reason: end_of_stream or shutdown
        self.error: Exception | None = None
        self.on_lost = on_lost  # called on the I/O thread once the broker is lost (exit_when_stuck)
        # 0 = auto: control on one I/O thread and one per data connection, where cores are to spare
        self._io_threads = io_threads or auto_io_threads(AUTO_DATA_STREAMS)
        self._ctx: zmq.Context | None = None  # made in start(), ended in close()
        self._control_out: queue.Queue = queue.Queue()  # small messages; never blocks callers
        self._wake_r, self._wake_w = os.pipe()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self.routing_id = f"{self.role}/{os.getpid()}/{secrets.token_hex(4)}/{instance}".encode()[:255]

    # ------------------------------------------------------------ lifecycle

    @property
    def run_id(self) -> str:
        return self.welcome.run

    @property
    def peer_id(self) -> str:
        return self.welcome.peer

    def start(self) -> Welcome:
        """Handshake, then start the I/O thread; returns the welcome. Raises BrokerUnreachable, Rejected."""
        self._ctx = zmq.Context(io_threads=self._io_threads)
        # our own routing ID: after a reconnect the broker's ROUTER knows us by it, so the session goes on
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
        run_config = self.welcome.run_config
        log.info("link.welcome", broker=self.broker, peer=self.peer_id, log_file=str(path),
                 run_config=run_config.fields() if run_config is not None else None)
        self._streams = self._open_data()
        self._data = self._streams[0]
        self._thread = threading.Thread(target=self._io_loop, name=f"dflash-io-{self.role}", daemon=True)
        freeze_setup()  # the process's imports and setup: no full GC pass over them (gcpause.py)
        self._thread.start()
        return self.welcome

    def _handshake(self, ctl) -> Welcome:
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
            reject = from_broker(Reject, msg.header)
            cls = RunMismatch if reject.code == "run_mismatch" else Rejected
            log.error("link.rejected", reason=reject.reason, code=reject.code)
            raise cls(reject.reason, reject.code)
        if msg.type != "welcome":
            raise ProtocolError(f"expected welcome, got {msg.type}", peer="broker")
        return from_broker(Welcome, msg.header)

    @abstractmethod
    def _open_data(self) -> list:
        """The role's data sockets, connected to the welcome's endpoints (the first is `_data`)."""

    def close(self, reason: str = "done", flush_timeout_s: float = 60.0) -> None:
        """Flush what the role still holds, say `bye`, stop the I/O thread, close sockets."""
        if self._thread is None:
            return
        self._wait_flushed(time.monotonic() + flush_timeout_s)
        self._closing.set()
        self._wake()
        self._thread.join(timeout=flush_timeout_s)
        if self.error is None and not self._thread.is_alive():
            # what was queued just before close (a last ack or commit) may be unsent: the socket is ours now
            self._flush_control()
        self._thread = None
        linger = self._data_linger_ms(flush_timeout_s) if self.error is None else 0
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

    def _wait_flushed(self, deadline: float) -> None:
        """Wait (until `deadline`) for what the I/O thread still has to send; a no-op unless the role queues data."""

    def _data_linger_ms(self, flush_timeout_s: float) -> int:
        """How long closing a data socket may wait to deliver what ZeroMQ holds (0 unless the role sends)."""
        return 0

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
        """Queue a control message; MessageTooLarge over the control limit (the broker's ZeroMQ would drop it)."""
        self._check()
        h = msg.to_header(self.run_id)
        n = len(codec.encode(h)[0])
        if n > MAX_HEADER_BYTES:
            raise MessageTooLarge(f"control message {msg.type!r} is {n} bytes, over the control limit of "
                                  f"{MAX_HEADER_BYTES} bytes (PROTOCOL.md 3): not sent")
        self._control_out.put(h)
        self._wake()

    def report_failure(self, msg: Message) -> None:
        """Queue a `failed` (PROTOCOL.md 4.2) ahead of close()'s `bye`; a failed link sends and raises nothing."""
        try:
            self.send_control(msg)
        except DFlashError:
            pass

    @abstractmethod
    def prefetched(self) -> int:
        """Batches waiting in the link: a consumer's inbox, a producer's outbox."""

    # ------------------------------------------------------------ I/O thread

    def _io_loop(self) -> None:
        name_this_thread(f"dflash-io-{self.role[:4]}")
        hb = float(self.welcome.heartbeat_s)
        timeout = float(self.welcome.timeout_s)
        last_rx = last_tx = time.monotonic()
        poller = zmq.Poller()
        poller.register(self._ctl, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        self._watch_data(poller)
        try:
            while not self._closing.is_set():
                self._before_poll(poller)
                events = dict(poller.poll(timeout=int(hb * 250)))
                now = time.monotonic()
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                if self._ctl in events:
                    while readable(self._ctl):
                        self._on_control(codec.recv(self._ctl, allowed=CONTROL_FROM_BROKER,
                                                    run=self.run_id, peer="broker"))
                    last_rx = now
                self._turn(events)
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

    def _watch_data(self, poller: zmq.Poller) -> None:
        """Register the data sockets the I/O thread waits on: none, unless the role reads data."""

    def _before_poll(self, poller: zmq.Poller) -> None:
        """Adjust what this turn's poll waits for: nothing, unless the role's wait changes."""

    @abstractmethod
    def _turn(self, events: dict) -> None:
        """The role's share of one I/O turn: its data and `_flush_control()`, in the role's order."""

    def _on_control(self, msg: codec.Message) -> None:
        if msg.type == "heartbeat":
            beat = from_broker(Heartbeat, msg.header)
            self.broker_plan = beat.planned_samples  # set before the stats: a reader of both sees it
            self.broker_progress = beat.budget_progress
            self.broker_stats = beat.stats
        elif msg.type == "stop":
            stop = from_broker(Stop, msg.header)
            log.info("link.stop", reason=stop.reason)
            self.stop_reason = stop.reason  # set before the event: readers see both
            self.stopped.set()
        elif msg.type == "reject":
            reject = from_broker(Reject, msg.header)
            log.error("link.rejected", reason=reject.reason, code=reject.code)
            raise Rejected(reject.reason, reject.code)

    def _flush_control(self) -> None:
        while True:
            try:
                h = self._control_out.get_nowait()
            except queue.Empty:
                return
            codec.send(self._ctl, h)

    def _send_heartbeat(self) -> None:
        try:
            stats: dict[str, Any] = dict(self.stats())
        except Exception as e:  # a broken stats callback must not kill liveness
            stats = {"stats_error": repr(e)}
        codec.send(self._ctl, Heartbeat(stats).to_header(self.run_id))


def from_broker(cls: type[Message], header: dict):
    """The broker's message `header` as `cls`, validated; a bad one is a ProtocolError naming the broker."""
    try:
        return cls.from_header(header)
    except ProtocolError as e:
        raise ProtocolError(e.reason, peer="broker") from None


# A broker started beside its peer may take many seconds to bind on a loaded host.
DIAL_TIMEOUT_S = 30.0


class BadBrokerAddress(DFlashError, ValueError):
    """--broker names no host that resolves, or is malformed: bad input, said before anything loads."""


def dial_broker(endpoint: str, curve: CurveClient | None = None, timeout_s: float = DIAL_TIMEOUT_S) -> None:
    """Check that a ZeroMQ endpoint answers at `endpoint` before the caller loads its model (a ZeroMQ
    handshake, not a bare connect, which the broker would log as a security mismatch).
    Raises BadBrokerAddress or BrokerUnreachable."""
    from .sockets import split_endpoint

    try:
        host, port = split_endpoint(endpoint)
    except ValueError as e:
        raise BadBrokerAddress(str(e)) from None
    try:
        _socket.getaddrinfo(host.strip("[]"), port, type=_socket.SOCK_STREAM)
    except (_socket.gaierror, UnicodeError) as e:
        reason = e.strerror if isinstance(e, _socket.gaierror) else str(e)
        raise BadBrokerAddress(f"broker {endpoint}: host {host!r} is not known ({reason}); check --broker "
                               "(DFLASH_BROKER)") from None
    answered = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.DEALER)
    mon = sock.get_monitor_socket(answered | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED)
    connected = refused = False
    try:
        sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(sock)
        sock.connect(f"tcp://{host}:{port}")
        deadline = time.monotonic() + timeout_s
        from zmq.utils.monitor import recv_monitor_message

        while (left := deadline - time.monotonic()) > 0:
            if not mon.poll(int(left * 1000) + 1):
                break
            event = recv_monitor_message(mon)["event"]
            if event & answered:
                return
            connected |= event == zmq.EVENT_CONNECTED
            refused |= event == zmq.EVENT_CONNECT_RETRIED
    finally:
        sock.disable_monitor()
        mon.close(linger=0)
        sock.close(linger=0)
        ctx.term()
    if connected:
        why = "a connection opened but no ZeroMQ handshake came back: is it a dflash-broker's --port?"
    elif refused:
        why = "connection refused or dropped: is the broker started, and is this its --port?"
    else:
        why = "no connection (a firewall, or a host that is down?)"
    raise BrokerUnreachable(f"broker {endpoint} did not answer within {timeout_s:g}s ({why}); check --broker "
                            "(DFLASH_BROKER)")


def dial_or_exit(broker: str, curve_keys: str | None, curve_name: str | None) -> None:
    """A peer's start-up check of --broker: exit 2 for an address that cannot be right, 1 for no answer."""
    from dflash.runtime.command_line import fail

    from .curve import client_from

    try:
        dial_broker(broker, client_from(curve_keys, curve_name))
    except BrokerUnreachable as e:
        fail(str(e), code=1)
    except DFlashError as e:  # BadBrokerAddress, CurveKeyError
        fail(str(e))
