"""The one helper that creates every ZeroMQ socket: bind or connect, HWM, buffers, linger,
maximum message size, optional CurveZMQ. Options are set before bind/connect, since
ZeroMQ applies most of them only to pipes created afterwards."""

from __future__ import annotations

from dataclasses import dataclass

import zmq


@dataclass(frozen=True)
class SocketOpts:
    sndhwm: int = 1000  # in messages; data sockets set small values (see PROTOCOL.md)
    rcvhwm: int = 1000
    linger_ms: int = 0  # never block exit on unsent messages; the ledger owns delivery
    maxmsgsize: int = -1  # bytes per frame, -1 = unlimited; the broker caps its inputs
    sndbuf: int = -1  # kernel socket buffer; -1 = OS default
    rcvbuf: int = -1
    immediate: bool = False  # queue only on completed connections


def make_socket(
    ctx: zmq.Context,
    kind: int,
    endpoint: str,
    *,
    bind: bool,
    opts: SocketOpts = SocketOpts(),
    identity: bytes | None = None,
) -> zmq.Socket:
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
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        (sock.bind if bind else sock.connect)(endpoint)
        return sock
    except Exception:
        sock.close(linger=0)
        raise


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
