"""Connections that fail ZeroMQ's handshake, from its socket monitor: logged, never silent.

Such a client (mismatched Curve, another broker's key) never gets a message through; only the
monitor sees it, and each failure becomes a `broker.handshake_failed` line saying what it likely means.
"""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from dflash.runtime.logs import get_logger

from .replies import LogGate

log = get_logger()

EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
# A protocol error's number -> its name without the prefix (mechanism_mismatch, cryptographic, ...)
PROTOCOL_ERRORS = {getattr(zmq, n): n[len("PROTOCOL_ERROR_"):].lower().removeprefix("zmtp_")
                   for n in dir(zmq) if n.startswith("PROTOCOL_ERROR_")}
MAX_EVENTS = 64  # read per turn: a client that retries every 100 ms cannot hold up the loop


def watch(sock: zmq.Socket) -> zmq.Socket:
    """The monitor of `sock`'s handshake failures; close it after `sock.disable_monitor()`."""
    return sock.get_monitor_socket(EVENTS)


def meaning(error: str, curve: bool) -> str:
    """What a handshake failure most likely means, for the operator."""
    if error == "mechanism_mismatch":
        return ("a client without CurveZMQ connected to this Curve broker: give it --curve-keys (docs/SECURITY.md)"
                if curve else "a client with CurveZMQ connected to this broker, which runs without --curve-keys")
    if error == "cryptographic":
        return ("a client whose broker key (its DIR/broker.key) is not this broker's, or whose keys are damaged: "
                "give it this broker's broker.key")
    if error == "no_detail":  # the client saw the mismatch first and hung up (a peer sending its hello does)
        return (f"the client closed the connection during the handshake: most likely its security does not match "
                f"this broker's, which runs {'with' if curve else 'without'} --curve-keys (a producer or consumer "
                f"{'without' if curve else 'with'} --curve-keys, or another broker's key), or it is not a ZeroMQ "
                "client")
    return "a client that does not speak ZMTP 3 as this broker does (another program on this port?)"


class HandshakeLog:
    """Reads monitors and logs their handshake failures, rate-limited per socket and error."""

    def __init__(self, curve: bool):
        self.curve = curve
        self.gate = LogGate(time.monotonic())

    def read(self, mon: zmq.Socket, socket: str) -> None:
        for _ in range(MAX_EVENTS):
            try:
                ev = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                error = PROTOCOL_ERRORS.get(ev["value"], f"protocol_error_{ev['value']}")
            else:
                error = "no_detail"
            ok, suppressed = self.gate.allow(f"handshake:{socket}:{error}", time.monotonic())
            if ok:
                log.warning("broker.handshake_failed", socket=socket, endpoint=ev["endpoint"].decode(errors="replace"),
                            error=error, curve=self.curve, hint=meaning(error, self.curve), suppressed=suppressed)

    def report(self, now: float, force: bool = False) -> None:
        """Log what the rate limit left out (broker.log_suppressed), as the core's gate does."""
        self.gate.report(now, force)
