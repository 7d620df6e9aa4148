"""The messages the broker core consumes (PROTOCOL.md 4), as protocol/messages.py types them.

Every message type, with its required and optional fields, is defined once in
protocol/messages.py; this module names the ones the core takes and adds what the broker
keeps of a batch beside its header (its frames, relayed as they came, and their sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.protocol import messages
from dflash.protocol.messages import Ack, Bye, Commit, Credit, Done, Heartbeat, Hello, LeaseAsk, LineageStart, local

__all__ = ["Ack", "Batch", "Bye", "Commit", "Credit", "Done", "Heartbeat", "Hello", "LeaseAsk", "LineageStart",
           "CONTROL"]


@dataclass(frozen=True)
class Batch(messages.Batch):
    """A `batch` on data in: its header fields and the frames as they came (relayed, never read)."""

    payload_bytes: int = local(default=0)  # the tensor frames' bytes
    header_bytes: int = local(default=0)  # the header frame's bytes: the queue's byte bound counts it too
    frames: list = local(default_factory=list, repr=False)


# Peer -> broker control messages after the handshake: type -> struct.
CONTROL = {cls.type: cls for cls in (LeaseAsk, Done, Credit, Ack, Commit, LineageStart, Heartbeat, Bye)}
