"""What reaches the broker core, as typed values: control messages (or an `Unreadable` saying why
one is refused), and each batch on data in as an `Arrival` without its frames, which stay with the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from dflash.protocol import codec, messages
from dflash.protocol.errors import ProtocolError
from dflash.protocol.messages import INSTANCE_PROPERTY, PEER_PROPERTY, Ack, Bye, Commit, Credit, Done, Failed, Heartbeat, Hello, LeaseAsk, LineageStart, Release, StatusAsk
from dflash.protocol.fields import PROTOCOL_VERSION
from dflash.protocol.fields import Message

from .replies import clip

# Peer -> broker control messages: type -> struct.
TO_BROKER: dict[str, type[Message]] = {
    cls.type: cls for cls in (Hello, StatusAsk, LeaseAsk, Done, Release, Credit, Ack, Commit, LineageStart, Heartbeat, Bye,
                              Failed)}


@dataclass(frozen=True)
class Unreadable:
    """A control message refused whoever sent it (`version`, `run_mismatch`, `bad_message`)."""

    code: str
    reason: str
    header: dict | None = None

    @property
    def type(self) -> object:
        """The type it claimed (None when its header did not parse)."""
        return self.header.get("type") if self.header is not None else None


def control_message(h: dict, error: str | None, run_id: str) -> Message | Unreadable:
    """The typed message of control header `h`, or why it is refused (`error`: the codec's refusal)."""
    if h.get("v") != PROTOCOL_VERSION:
        return Unreadable("version", f"protocol version {h.get('v')!r} is not supported: this broker speaks "
                          f"version {PROTOCOL_VERSION}; upgrade or downgrade dflash", h)
    if "run" in h and h["run"] != run_id:
        return Unreadable("run_mismatch", f"run {h['run']!r} is not the run this broker serves ({run_id}); that "
                          "run is over or served elsewhere: leave out --run-id to join this one", h)
    if error is not None:
        return Unreadable("bad_message", error, h)
    cls = TO_BROKER.get(h.get("type"))
    if cls is None:  # the codec refuses these first; a caller that skipped it gets the same word
        return Unreadable("bad_message", f"message type {clip(h.get('type'))!r} not accepted on this socket", h)
    try:
        return cls.from_header(h)
    except ProtocolError as e:
        return Unreadable("bad_message", e.reason, h)


@dataclass(frozen=True)
class TokenIds:
    """The smallest and largest of a batch's `input_ids`: fit.py checks them against the vocabulary."""

    lo: int
    hi: int


@dataclass(frozen=True)
class Arrival:
    """A `batch` on data in as the core sees it: the typed `Batch` without tensors, and what the server
    read off its frames."""

    batch: messages.Batch
    payload_bytes: int  # the tensor frames' bytes
    header_bytes: int  # the header frame's bytes: the queue's byte bound counts it too
    conn: dict = field(default_factory=dict)  # the connection it came on (connection())
    token_ids: TokenIds | None = None  # None: no input_ids, or none in it

    @classmethod
    def read(cls, batch: messages.Batch, header: dict, frames: list) -> "Arrival":
        """The arrival of `batch` decoded from `frames`, without the frames."""
        return cls(replace(batch, frames=[]), codec.payload_bytes(frames), len(frames[0]), connection(frames[0]),
                   token_ids(header, frames))


def token_ids(header: dict, frames: list) -> TokenIds | None:
    """The range of the batch's `input_ids`, read in place with numpy (no copy, no torch); None if empty."""
    for i, spec in enumerate(header.get("tensors") or ()):
        if spec.get("name") == "input_ids":
            frame = frames[1 + i]
            ids = np.frombuffer(getattr(frame, "buffer", frame), dtype="<i4")
            return TokenIds(int(ids.min()), int(ids.max())) if ids.size else None
    return None


@dataclass(frozen=True)
class BadBatch:
    """A data-in message the codec refused: who sent it, why, and the connection it came on."""

    sender: str
    reason: str
    conn: dict


def connection(frame) -> dict:
    """What ZeroMQ knows of a data-in frame's connection: address, Curve key, and ZMTP peer/instance."""
    out = {}
    for name, prop in (("address", "Peer-Address"), ("key", "User-Id"), ("peer", PEER_PROPERTY),
                       ("instance", INSTANCE_PROPERTY)):
        try:
            value = frame.get(prop)
        except Exception:  # not a zmq.Frame (tests of the core), or the property is not there
            continue
        if value:
            out[name] = value[:128]
    return out


def connection_fields(conn: dict) -> dict:
    """Log fields naming the connection a data-in message came on (connection())."""
    return {"peer_address": conn.get("address"), "connection_peer": clip(conn.get("peer"), 64),
            "connection_instance": clip(conn.get("instance"), 128), "curve_key": conn.get("key")}
