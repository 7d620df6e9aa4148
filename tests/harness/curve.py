"""CurveZMQ from the test side: a client DEALER, the status asked over Curve, and a broker
process started with --curve-keys."""

from __future__ import annotations

from pathlib import Path

import msgpack
import zmq

from dflash.protocol.curve import client_keys

from .broker import BrokerProc


def curve_dealer(endpoint: str, keys: Path | None, name: str | None) -> zmq.Socket:
    """A DEALER that is a CURVE client with keypair `name` of `keys` (plain if keys is None).
    A send waits at most two seconds: a refused handshake can leave it no pipe to queue on."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 2000)
    if keys is not None:
        client_keys(keys, name).apply(s)
    s.connect(endpoint)
    return s


def curve_status(endpoint: str, keys: Path | None, name: str | None, timeout_s: float = 2.0) -> dict | None:
    """The broker's status map asked over Curve, or None if it does not answer."""
    s = curve_dealer(endpoint, keys, name)
    try:
        try:
            s.send(msgpack.packb({"v": 1, "type": "status"}))
        except zmq.Again:
            return None
        if s.poll(int(timeout_s * 1000)):
            return msgpack.unpackb(s.recv_multipart()[0], strict_map_key=False)["status"]
        return None
    finally:
        s.close()


class CurveBrokerProc(BrokerProc):
    """A broker started with --curve-keys; its liveness probe speaks Curve as `probe_name`."""

    def __init__(self, runs_dir: Path, args: list[str], keys: Path, probe_name: str, n_out: int = 8):
        self.keys, self.probe_name = keys, probe_name
        super().__init__(runs_dir, ["--curve-keys", str(keys), *args], n_out)

    def ask(self, timeout_s: float = 2.0) -> dict | None:
        return curve_status(self.control, self.keys, self.probe_name, timeout_s)
