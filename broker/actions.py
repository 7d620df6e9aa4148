"""What the broker core asks its server to do (the core decides, server.py does).

Parts write into one `Outbox`; each entry point returns its actions in order. `OpenPipes` and a
`Relay` are answered as data (`BrokerCore.on_pipes`, `BrokerCore.relayed`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.protocol.messages import Hello
from dflash.protocol.fields import Message


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
class Joining:
    """A consumer's hello that passed every check but its pipes, handed back once they are bound."""

    identity: bytes
    hello: Hello
    key: str | None  # the Curve key's name its connection used
    rank: int | None
    now: float  # when the hello came


@dataclass(frozen=True)
class OpenPipes:
    """Bind the first `len(threads)` of `ports` that bind, the k-th on I/O thread `threads[k]`."""

    ports: tuple[int, ...]
    threads: tuple[int, ...]
    joining: Joining


@dataclass(frozen=True)
class ClosePipes:
    """Close the data-out pipes on these ports (what they still queue is dropped)."""

    ports: tuple[int, ...]


@dataclass(frozen=True)
class DropFrames:
    """Let go of these batches' frames: trained or quarantined, never sent again."""

    batch_ids: tuple[str, ...]


@dataclass(frozen=True)
class Publish:
    """Hand the status map to the --metrics-port endpoint."""

    status: dict


Action = Send | OpenPipes | ClosePipes | DropFrames | Publish


@dataclass(frozen=True)
class Relay:
    """Dispatch's pick (not an outbox action): send `batch_id`'s frames on the first of `ports` that takes them."""

    consumer: str
    batch_id: str
    ports: tuple[int, ...]


class Outbox:
    """The actions the core's parts decided, in order, until the entry point hands them over."""

    def __init__(self):
        self._actions: list[Action] = []

    def send(self, identity: bytes, msg: Message) -> None:
        self._actions.append(Send(identity, msg))

    def open_pipes(self, ports: list[int], threads: list[int], joining: Joining) -> None:
        self._actions.append(OpenPipes(tuple(ports), tuple(threads), joining))

    def close_pipes(self, ports: list[int]) -> None:
        if ports:
            self._actions.append(ClosePipes(tuple(ports)))

    def drop_frames(self, batch_ids: list[str]) -> None:
        if batch_ids:
            self._actions.append(DropFrames(tuple(batch_ids)))

    def publish(self, status: dict) -> None:
        self._actions.append(Publish(status))

    def take(self) -> list[Action]:
        out, self._actions = self._actions, []
        return out
