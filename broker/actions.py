"""What the broker core asks its server to do (core.py decides, server.py does).

The core never touches a socket: each of its entry points returns a list of these, in
order, and the server carries them out with its sockets. Relaying a batch is the one
exception: whether a consumer's pipe takes a batch decides whether it stays queued, so
`BrokerCore.dispatch` calls the server's non-blocking send as it goes.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.protocol.messages import Message


@dataclass(frozen=True)
class Send:
    """Send control message `msg` to ROUTER `identity` (never blocking)."""

    identity: bytes
    msg: Message

    @property
    def type(self) -> str:
        return self.msg.type

    @property
    def fields(self) -> dict:
        """The message's fields as they go on the wire."""
        return self.msg.fields()


@dataclass(frozen=True)
class ClosePipes:
    """Close a consumer's data-out sockets (what they still queue is dropped)."""

    pipes: list


@dataclass(frozen=True)
class Publish:
    """Hand the status map to the --metrics-port endpoint."""

    status: dict


Action = Send | ClosePipes | Publish
