"""What the broker core asks its server to do (the core decides, server.py does).

The core never touches a socket: its parts write what is to be done into one `Outbox`,
and each entry point of the core returns what was written, in order, for the server to
carry out with its sockets. Relaying a batch is the one exception: whether a consumer's
pipe takes a batch decides whether it stays queued, so `BrokerCore.dispatch` calls the
server's non-blocking send as it goes.
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
class DropFrames:
    """Let go of these batches' frames: trained or quarantined, never sent again."""

    batch_ids: tuple[str, ...]


@dataclass(frozen=True)
class Publish:
    """Hand the status map to the --metrics-port endpoint."""

    status: dict


Action = Send | ClosePipes | DropFrames | Publish


class Outbox:
    """The actions the core's parts decided, in order, until the entry point hands them over."""

    def __init__(self):
        self._actions: list[Action] = []

    def send(self, identity: bytes, msg: Message) -> None:
        self._actions.append(Send(identity, msg))

    def close_pipes(self, pipes: list) -> None:
        if pipes:
            self._actions.append(ClosePipes(list(pipes)))

    def drop_frames(self, batch_ids: list[str]) -> None:
        if batch_ids:
            self._actions.append(DropFrames(tuple(batch_ids)))

    def publish(self, status: dict) -> None:
        self._actions.append(Publish(status))

    def take(self) -> list[Action]:
        out, self._actions = self._actions, []
        return out
