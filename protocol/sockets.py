"""The one helper that creates every ZeroMQ socket, and frame-level send/recv. Options are set
before bind/connect, since ZeroMQ applies most of them only to pipes created afterwards."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

if TYPE_CHECKING:
    from .curve import CurveClient, CurveServer


# A second I/O thread gives data a core away from control traffic, but on few cores it is slower.
AUTO_TWO_IO_CPUS = 8


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# Data streams per consumer where the threads exist: one thread sending small batches tops out early.
AUTO_DATA_STREAMS = 2


def auto_io_threads(data_threads: int = 1) -> int:
    """1 + `data_threads` where this process may use at least AUTO_TWO_IO_CPUS cores, else 1."""
    return 1 + data_threads if usable_cpus() >= AUTO_TWO_IO_CPUS else 1


def first_thread(io_threads: int) -> int:
    """ZMQ_AFFINITY mask of the first I/O thread (0 = any, with one thread)."""
    return 1 if io_threads > 1 else 0


def other_threads(io_threads: int) -> int:
    """ZMQ_AFFINITY mask of every I/O thread but the first (0 = any, with one thread)."""
    return ((1 << io_threads) - 1) & ~1 if io_threads > 1 else 0


def nth_other_thread(io_threads: int, i: int) -> int:
    """ZMQ_AFFINITY mask of the i-th thread after the first, in turn (0 = any, with one thread)."""
    return 1 << (1 + i % (io_threads - 1)) if io_threads > 1 else 0


@dataclass(frozen=True)
class SocketOpts:
    sndhwm: int = 1000  # in messages; data sockets set small values (see PROTOCOL.md)
    rcvhwm: int = 1000
    linger_ms: int = 0  # never block exit on unsent messages; the ledger owns delivery
    maxmsgsize: int = -1  # bytes per frame, -1 = unlimited; the broker caps its inputs
    sndbuf: int = -1  # kernel socket buffer; -1 = OS default
    rcvbuf: int = -1
    immediate: bool = False  # queue only on completed connections
    affinity: int = 0  # bitmask of the context's I/O threads its connections may use; 0 = any
    curve: CurveServer | CurveClient | None = None  # CurveZMQ keys (protocol/curve.py); None = plain
    metadata: tuple[tuple[str, str], ...] = ()


def make_socket(
    ctx: zmq.Context,
    kind: int,
    endpoint: str,
    *,
    bind: bool,
    opts: SocketOpts = SocketOpts(),
    identity: bytes | None = None,
) -> zmq.Socket:
    """A socket of `kind`, options set, bound or connected; on zmq.ZMQError the half-made socket is closed."""
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, opts.linger_ms)
        sock.setsockopt(zmq.SNDHWM, opts.sndhwm)
        sock.setsockopt(zmq.RCVHWM, opts.rcvhwm)
        if opts.maxmsgsize >= 0:
            sock.setsockopt(zmq.MAXMSGSIZE, opts.maxmsgsize)
        if opts.sndbuf > 0:
            sock.setsockopt(zmq.SNDBUF, opts.sndbuf)
        if opts.rcvbuf > 0:
            sock.setsockopt(zmq.RCVBUF, opts.rcvbuf)
        if opts.immediate:
            sock.setsockopt(zmq.IMMEDIATE, 1)
        if opts.affinity:
            sock.setsockopt(zmq.AFFINITY, opts.affinity)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if opts.curve is not None:
            opts.curve.apply(sock)
        for name, value in opts.metadata:
            sock.setsockopt(zmq.METADATA, f"{name}:{value}".encode())
        (sock.bind if bind else sock.connect)(endpoint)
        return sock
    except Exception:
        sock.close(linger=0)
        raise


# Frame by frame with plain int flags: pyzmq's *_multipart per-frame checks were a large share of the relay's time.
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list:
    """One multipart message as zmq.Frames (no copy); zmq.Again with NOBLOCK when nothing is there."""
    flags = int(flags)
    f = sock.recv(flags, copy=False)
    frames = [f]
    while f.more:
        f = sock.recv(flags, copy=False)
        frames.append(f)
    return frames


_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def readable(sock: zmq.Socket) -> bool:
    """A whole message waits on `sock` (cheaper than raising zmq.Again)."""
    return bool(sock.get(_EVENTS) & _POLLIN)


def send_frames(sock: zmq.Socket, frames: list, flags: int = 0) -> None:
    """Send `frames` as one message without copying large ones; with NOBLOCK only the first part can raise zmq.Again."""
    flags = int(flags)
    more = flags | _SNDMORE
    last = len(frames) - 1
    for i, f in enumerate(frames):
        sock.send(f, more if i < last else flags, copy=False)


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """`tcp://HOST[:PORT]` -> (host, port); port defaults to 5555. Raises ValueError."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"broker address {endpoint!r} must look like tcp://HOST[:PORT]")
    rest = endpoint[len("tcp://"):]
    host, sep, port = rest.rpartition(":")
    if not sep or "]" in port:
        return rest, 5555
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"broker address {endpoint!r}: port {port!r} is not a TCP port")
    return host, int(port)


def free_port_block(n: int, host: str = "127.0.0.1") -> int:
    """First of `n` consecutive TCP ports free on `host` (local runs, tests); RuntimeError if none found."""
    import random
    import socket

    for _ in range(200):
        base = random.randint(20000, 60000 - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports on {host}")
