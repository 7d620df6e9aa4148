"""What the broker core asks its server to do (the core decides, server.py does).

The core holds no socket and no frame: its parts write what is to be done into one
`Outbox`, and each entry point of the core returns what was written, in order, for the
server to carry out. The server owns every socket (control, data in, each consumer's
pipes by port) and the frames of every batch the core holds (by batch ID). Two actions
need an answer, which the server gives the core as data: `OpenPipes` (the ports that
bound, to `BrokerCore.on_pipes`), and relaying a batch (which pipe took it, to
`BrokerCore.relayed`).
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
    """A consumer's hello that passed every check but its pipes: what the core needs to
    finish it once they are bound (the server hands it back untouched)."""

    identity: bytes
    hello: Hello
    key: str | None  # the Curve key's name its connection used
    rank: int | None
    now: float  # when the hello came


@dataclass(frozen=True)
class OpenPipes:
    """Bind a joining consumer's data-out pipes: of `ports`, in order, the first
    `len(threads)` that bind, the k-th on I/O thread `threads[k]` (an affinity mask); then
    hand the ports that bound, in order, to `BrokerCore.on_pipes` with this action."""

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
    """Dispatch's pick (`BrokerCore.dispatch`, not an outbox action): send batch
    `batch_id`'s frames to consumer `consumer` on the first of its pipes, on `ports` in
    this order, that takes them now without blocking. The server answers
    `BrokerCore.relayed` with the port that took them, or None."""

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
