"""Each role's link to the broker: peer.py's `PeerLink` plus that role's data side and calls.
`ProducerLink.push_batch` blocks while the outbox is full (the broker's backpressure);
`ConsumerLink.next_batch` grants credit for free room in its inbox (credit.py).
"""

from __future__ import annotations

import queue
import time
from typing import Callable

import zmq

from dflash.runtime.logs import get_logger

from . import codec
from .batch import Batch
from .credit import CreditWindow
from .errors import MessageTooLarge, ProtocolError
from .messages import (INSTANCE_PROPERTY, MAX_HEADER_BYTES, PEER_PROPERTY, Ack, Commit, Credit, Done, Grant, LeaseAsk,
                       Release, Revoke)
from .peer import PeerLink, from_broker
from .sockets import SocketOpts, make_socket, nth_other_thread, other_threads, readable, recv_frames, send_frames

log = get_logger()

MAX_AUTO_CREDIT = 16  # the deepest inbox small batches get (credit.py); the broker caps at max_credit


class ProducerLink(PeerLink):
    """A producer's link: leases on the control socket, batches out through a bounded outbox."""

    role = "producer"

    def __init__(self, broker: str, instance: str, *, outbox_batches: int = 2, **kw):
        super().__init__(broker, instance, **kw)
        self._outbox: queue.Queue = queue.Queue(maxsize=max(1, outbox_batches))
        self._grants: queue.Queue = queue.Queue()
        self._pending_batch: list | None = None  # frames a full PUSH pipe refused, sent next turn
        # (lease, n) -> up to n samples of that lease given back, called on the I/O thread
        self.on_revoke: Callable[[int, int], list[int]] | None = None

    def _open_data(self) -> list:
        # A tiny send HWM, so backpressure reaches the producer as soon as the broker stops reading;
        # one PUSH connected once per data stream, naming us in its metadata (PROTOCOL.md 1).
        endpoints = self.welcome.streams(self.welcome.data_in)
        named = ((PEER_PROPERTY, self.peer_id), (INSTANCE_PROPERTY, self.instance))
        sock = make_socket(self._ctx, zmq.PUSH, endpoints[0], bind=False,
                           opts=SocketOpts(sndhwm=1, linger_ms=-1, curve=self.curve,
                                           affinity=other_threads(self._io_threads), metadata=named))
        for endpoint in endpoints[1:]:
            sock.connect(endpoint)
        return [sock]

    def _wait_flushed(self, deadline: float) -> None:
        while self.error is None and time.monotonic() < deadline:
            if self._outbox.empty() and self._pending_batch is None:
                break
            time.sleep(0.01)

    def _data_linger_ms(self, flush_timeout_s: float) -> int:
        # deliver what ZeroMQ holds before bye, or the broker returns leases whose batches are in transit
        return int(flush_timeout_s * 1000)

    # ------------------------------------------------------------ caller API

    def request_lease(self, want: int, timeout_s: float | None = None) -> Grant:
        """Ask for up to `want` samples; returns the broker's `grant` (may be empty, see `end`)."""
        self.send_control(LeaseAsk(want))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._check()
            try:
                return self._grants.get(timeout=0.1)
            except queue.Empty:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"no grant from the broker within {timeout_s}s") from None

    def push_batch(self, batch: Batch, timeout_s: float | None = None) -> None:
        """Queue one batch naming this link's peer ID; blocks while the outbox is full."""
        if batch.producer != self.peer_id:
            raise ValueError(f"batch {batch.batch_id} names producer {batch.producer!r}, this link is {self.peer_id!r}")
        frames = codec.encode_batch(batch, self.run_id)
        self._check_size(batch.batch_id, frames)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._check()
            try:
                self._outbox.put(frames, timeout=0.1)
                self._wake()
                return
            except queue.Full:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError("outbox still full: the broker is not reading") from None

    def _check_size(self, batch_id: str, frames: list) -> None:
        """Refuse a batch over the broker's limits before it leaves: the broker would drop it."""
        run_config = self.welcome.run_config
        limit = run_config.max_message_bytes if run_config is not None else self.max_message_bytes
        payload = codec.payload_bytes(frames)
        if len(frames[0]) > MAX_HEADER_BYTES or payload > limit:
            raise MessageTooLarge(
                f"batch {batch_id} is {payload} tensor bytes (header {len(frames[0])}), over the broker's "
                f"limit of {limit} bytes per message (header {MAX_HEADER_BYTES}): not sent; lower "
                "--token-budget or --max-batch-size, or raise the broker's --max-message-bytes")

    def lease_done(self, lease: int, skipped: list) -> None:
        self.send_control(Done(lease, [[int(s), str(r)] for s, r in skipped]))

    def prefetched(self) -> int:
        return self._outbox.qsize()

    # ------------------------------------------------------------ I/O thread

    def _before_poll(self, poller: zmq.Poller) -> None:
        # a refused batch: wake when the pipe has room, not at the next heartbeat tick
        poller.modify(self._data, zmq.POLLOUT if self._pending_batch is not None else 0)

    def _turn(self, events: dict) -> None:
        self._flush_control()
        self._flush_batches()

    def _on_control(self, msg: codec.Message) -> None:
        if msg.type == "grant":
            self._grants.put(from_broker(Grant, msg.header))
        elif msg.type == "revoke":  # another producer has nothing: give back what we have not started
            r = from_broker(Revoke, msg.header)
            samples = self.on_revoke(r.lease, r.n) if self.on_revoke is not None else []
            log.info("link.revoke", lease=r.lease, n=r.n, released=len(samples))
            self.send_control(Release(r.lease, samples))
        else:
            super()._on_control(msg)

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


class ConsumerLink(PeerLink):
    """A consumer's link: batches in on one PULL per data stream into an inbox bounded by its credit."""

    role = "consumer"

    def __init__(self, broker: str, instance: str, *, inbox_batches: int = 2, inbox_bytes: int | None = None,
                 **kw):
        super().__init__(broker, instance, **kw)
        self._inbox: queue.Queue = queue.Queue()  # bounded by the credit we grant
        self._inbox_bounds = (inbox_batches, inbox_bytes)
        self._credit: CreditWindow | None = None

    def _open_data(self) -> list:
        run_config = self.welcome.run_config  # the broker's cap on credit, if it says one
        most = min(MAX_AUTO_CREDIT, run_config.max_credit if run_config is not None else MAX_AUTO_CREDIT)
        self._credit = CreditWindow(self._inbox_bounds[0], self._inbox_bounds[1], max_batches=most)
        self._wake()  # so the I/O thread's first poll returns at once and grants it
        # one PULL per data stream the broker opened, each on an I/O thread of its own while there are any
        endpoints = self.welcome.streams(self.welcome.data_out)
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
        self.stream_batches = [0] * len(socks)  # batches received on each data stream
        return socks

    # ------------------------------------------------------------ caller API

    def next_batch(self, timeout_s: float | None = None) -> Batch | None:
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
            # decoded on the caller's thread: the I/O thread was the busiest at many small batches
            try:
                return codec.decode_batch(frames, run=self.run_id, peer="broker")
            except ProtocolError as e:
                log.error("link.bad_message", reason=e.reason, peer="broker")

    def ack(self, batch_ids: list[str], step: int, lineage: str | None = None) -> None:
        self.send_control(Ack(list(batch_ids), int(step), lineage or None))

    def commit(self, step: int, checkpoint: str, lineage: str | None = None) -> None:
        self.send_control(Commit(int(step), str(checkpoint), lineage or None))

    def prefetched(self) -> int:
        return self._inbox.qsize()

    # ------------------------------------------------------------ I/O thread

    def _watch_data(self, poller: zmq.Poller) -> None:
        for sock in self._streams:
            poller.register(sock, zmq.POLLIN)

    def _turn(self, events: dict) -> None:
        for i, sock in enumerate(self._streams):
            if sock in events:
                self._drain_data(i)
        self._grant_credit()
        self._flush_control()

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
