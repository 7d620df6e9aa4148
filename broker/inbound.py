"""The messages the broker core consumes (PROTOCOL.md 4), as protocol/messages.py types them.

Every message type, with its required and optional fields, is defined once in
protocol/messages.py; this module names the ones the core takes and adds what the broker
keeps of a batch beside its header (its frames, relayed as they came, and their sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.protocol import messages
from dflash.protocol.messages import (INSTANCE_PROPERTY, PEER_PROPERTY, Ack, Bye, Commit, Credit, Done, Failed,
                                     Heartbeat, Hello, LeaseAsk, LineageStart, local)

__all__ = ["Ack", "Batch", "Bye", "Commit", "Credit", "Done", "Failed", "Heartbeat", "Hello", "LeaseAsk",
           "LineageStart", "CONTROL"]


@dataclass(frozen=True)
class Batch(messages.Batch):
    """A `batch` on data in: its header fields and the frames as they came (relayed, never read)."""

    payload_bytes: int = local(default=0)  # the tensor frames' bytes
    header_bytes: int = local(default=0)  # the header frame's bytes: the queue's byte bound counts it too
    frames: list = local(default_factory=list, repr=False)

    def connection(self) -> dict:
        """Who sent it, as its connection says (connection() of its header frame)."""
        return connection(self.frames[0]) if self.frames else {}


def connection(frame) -> dict:
    """What ZeroMQ knows of the connection a data-in frame came on: `address` (the sender's
    IP: all producers of one host share it), `key` (the Curve key's name), and what the sender
    said it is, `peer` and `instance` (its ZMTP metadata). Missing ones are left out."""
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


# Peer -> broker control messages after the handshake: type -> struct.
CONTROL = {cls.type: cls for cls in (LeaseAsk, Done, Credit, Ack, Commit, LineageStart, Heartbeat, Bye, Failed)}
