"""Typed views of the messages the broker core consumes (PROTOCOL.md 4).

The codec (protocol/codec.py) has checked each header against protocol/messages.py's
SCHEMAS (required fields and their types) before one of these is built, so `from_header`
only names the fields: required ones as plain attributes, optional ones with their
default, in one place per message. `raw` keeps the header itself, for what a `reject`
echoes (`answers`) and for log lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Hello:
    role: str
    instance: str
    host: str
    pid: int
    config: dict = field(default_factory=dict)  # optional; a non-map is refused by the core
    gpu: int | None = None  # optional
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_header(cls, h: dict) -> "Hello":
        return cls(h["role"], h["instance"], h["host"], h["pid"], h.get("config") or {},
                   h.get("gpu") if isinstance(h.get("gpu"), int) else None, h)


@dataclass(frozen=True)
class LeaseAsk:
    """`lease {want}`: a producer asks for up to `want` samples."""

    want: int
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_header(cls, h: dict) -> "LeaseAsk":
        return cls(h["want"], h)


@dataclass(frozen=True)
class Done:
    """`done {lease, skipped}`: a producer made what it could of a lease."""

    lease: int
    skipped: list  # [sample, reason] pairs
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_header(cls, h: dict) -> "Done":
        return cls(h["lease"], h["skipped"], h)


@dataclass(frozen=True)
class Credit:
    credit: int
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_header(cls, h: dict) -> "Credit":
        return cls(h["credit"], h)


@dataclass(frozen=True)
class Ack:
    batch_ids: list
    step: int
    lineage: object = None  # optional: a str names the lineage; anything else is the default one
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_header(cls, h: dict) -> "Ack":
        return cls(h["batch_ids"], h["step"], h.get("lineage"), h)


@dataclass(frozen=True)
class Commit:
    step: int
    checkpoint: str
    lineage: object = None  # optional, as in Ack
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_header(cls, h: dict) -> "Commit":
        return cls(h["step"], h["checkpoint"], h.get("lineage"), h)


@dataclass(frozen=True)
class LineageStart:
    """`lineage {lineage, step, parent?, checkpoint?}`: a consumer starts new weights."""

    lineage: str
    step: int
    parent: object = None  # optional: the lineage it starts from (a str), else from nothing
    checkpoint: str | None = None  # optional: the checkpoint it loaded, for log lines
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_header(cls, h: dict) -> "LineageStart":
        return cls(h["lineage"], h["step"], h.get("parent"), h.get("checkpoint"), h)


@dataclass(frozen=True)
class Heartbeat:
    stats: dict
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_header(cls, h: dict) -> "Heartbeat":
        return cls(h["stats"], h)


@dataclass(frozen=True)
class Bye:
    reason: str
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_header(cls, h: dict) -> "Bye":
        return cls(h["reason"], h)


@dataclass(frozen=True)
class Batch:
    """A `batch` on data in: its header fields and the frames as they came (relayed, never read)."""

    batch_id: str
    producer: str
    lease: int
    epoch: int
    samples: list
    seq_lens: list
    layer_ids: list
    payload_bytes: int  # the tensor frames' bytes
    header_bytes: int  # the header frame's bytes: the queue's byte bound counts it too
    frames: list = field(default_factory=list, repr=False)
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_header(cls, h: dict, payload_bytes: int, header_bytes: int, frames: list) -> "Batch":
        return cls(h["batch_id"], h["producer"], h["lease"], h["epoch"], h["samples"], h["seq_lens"],
                   h["layer_ids"], payload_bytes, header_bytes, frames, h)


# Peer -> broker control messages after the handshake: type -> struct.
CONTROL = {"lease": LeaseAsk, "done": Done, "credit": Credit, "ack": Ack, "commit": Commit,
           "lineage": LineageStart, "heartbeat": Heartbeat, "bye": Bye}
