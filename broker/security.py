"""The broker's CurveZMQ side (protocol/curve.py, docs/SECURITY.md): its keys, the ZAP
authenticator that admits only authorised client keys, and the warning for a broker that
listens beyond this host without Curve."""

from __future__ import annotations

import time

import zmq

from dflash.protocol import curve
from dflash.runtime.logs import get_logger

from .replies import LogGate

log = get_logger()

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def setup(curve_keys: str | None, ctx: zmq.Context):
    """(server keys, running authenticator), or (None, None) without `curve_keys`.
    Call before binding any socket. Raises CurveKeyError, RuntimeError."""
    if not curve_keys:
        return None, None
    server = curve.server_keys(curve_keys)
    return server, curve.start_authenticator(ctx, server, _denied_logger())


def _denied_logger():
    """broker.curve_denied, rate-limited: a refused client reconnects again and again."""
    gate = LogGate(time.monotonic())  # used by the authenticator thread only

    def denied(key: str) -> None:
        ok, suppressed = gate.allow(f"curve:{key}", time.monotonic())
        if ok:
            log.warning("broker.curve_denied", key=key, suppressed=suppressed,
                        hint="not in the broker's authorized/ folder: add its .key there to admit it")

    return denied


def warn_if_open(bind: str, curve_on: bool) -> None:
    """Warn when the broker listens beyond loopback without Curve."""
    if not curve_on and bind not in LOOPBACK:
        log.warning("broker.insecure", bind=bind,
                    reason="CurveZMQ is off and the broker listens beyond loopback: anyone who reaches its ports "
                           "can read batches, inject data and exhaust its memory; use --curve-keys "
                           "(docs/SECURITY.md) or --bind 127.0.0.1")
