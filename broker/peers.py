"""Peer sessions: one per producer or consumer that got `welcome`, a type for each role, and their
table. Peer IDs are never reused within a run, so a log line naming `c2` means one process.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from .dispatch import Queued
from .liveness import RateMeter, TimeShare
from .statements import ConsumerStatement, ProducerStatement

LOST_HISTORY = 32  # lost/left peers kept for the status map


@dataclass(frozen=True)
class Failure:
    """Why a peer stopped: its `failed` message, or the broker's refusal of its batch."""

    code: str | None
    reason: str | None
    hint: str | None = None
    source: str | None = None  # a bad row's file:line
    batch_id: str | None = None  # the batch a consumer could not train, or a producer's refused one
    fault: str | None = None  # what is wrong with that batch

    def fields(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ProducerHeld:
    """What a producer held when its session ended: its open leases, given back."""

    leases: list[int]
    samples_returned: int
    batches_in: int


@dataclass(frozen=True)
class ConsumerHeld:
    """What a consumer held when its session ended: batches delivered and not acked, requeued."""

    in_flight: int
    batch_ids: list[str]
    credit: int
    delivered: int
    acked: int
    rank: int | None


@dataclass(eq=False)
class Pipes:
    """A consumer's data-out streams: per stream its I/O thread, port and endpoint; `next` is tried first."""

    threads: list[int]
    ports: list[int]
    endpoints: list[str]
    next: int = 0

    def in_turn(self) -> tuple[int, ...]:
        """The ports in the order the next batch tries them."""
        i = self.next % len(self.ports)
        return tuple(self.ports[i:] + self.ports[:i])

    def took(self, port: int) -> None:
        """The pipe on `port` took a batch: the next one tries the pipe after it first."""
        self.next = self.ports.index(port) + 1


@dataclass(eq=False, kw_only=True)
class Session:
    """Who a peer is, when it was last heard, its heartbeat figures, and (once gone) how it went."""

    role: ClassVar[str]
    id: str
    identity: bytes  # ROUTER identity of its control DEALER
    instance: str
    host: str
    pid: int
    gpu: int | None
    joined_at: float  # wall clock
    last_seen: float  # monotonic: any message counts
    curve_key: str | None = None  # the authorised Curve key it joined with (None without Curve)
    stats: dict = field(default_factory=dict)  # its latest heartbeat's figures (sanitised: status.sanitize_stats)
    stats_at: float | None = None  # wall clock
    state: str = "live"  # live | lost | left
    gone_at: float | None = None  # wall clock
    gone_reason: str | None = None
    held: ProducerHeld | ConsumerHeld | None = None  # what it held when it went
    failure: Failure | None = None
    rate_in: RateMeter = field(default_factory=RateMeter)  # batches from (producer) or to (consumer) it
    rate_tokens: RateMeter = field(default_factory=RateMeter)

    @property
    def live(self) -> bool:
        return self.state == "live"

    def describe(self) -> dict[str, Any]:
        """Identity fields for log lines; `peer_*` so they never shadow our own."""
        return {"peer": self.id, "peer_role": self.role, "peer_instance": self.instance,
                "peer_host": self.host, "peer_pid": self.pid, "peer_gpu": self.gpu}


@dataclass(eq=False, kw_only=True)
class ProducerSession(Session):
    role: ClassVar[str] = "producer"
    said: ProducerStatement = field(default_factory=ProducerStatement)
    batches_in: int = 0
    bytes_in: int = 0
    samples_in: int = 0
    stale: int = 0  # batches dropped as stale


@dataclass(eq=False, kw_only=True)
class ConsumerSession(Session):
    role: ClassVar[str] = "consumer"
    said: ConsumerStatement = field(default_factory=ConsumerStatement)
    pipes: Pipes
    rank: int | None = None
    credit: int = 0
    last_served: int = 0
    in_flight: OrderedDict[str, Queued] = field(default_factory=OrderedDict)
    waiting_since: float | None = None  # credit > 0 and nothing to send it
    wait_share: TimeShare  # how much of the last 10 s it waited
    delivered: int = 0
    acked: int = 0
    lineage_steps: dict[str, int] = field(default_factory=dict)  # lineage -> highest step it may commit
    # the ack deadline's clock (latest ack, or delivery to an empty hand) and its slowest ack gap
    progress_at: float
    slowest_ack_gap: float = 0.0


class PeerTable:
    """Live sessions by ROUTER identity and by peer ID, plus a short history of the gone."""

    def __init__(self):
        self._counters = {"producer": 0, "consumer": 0}
        self.by_identity: dict[bytes, Session] = {}
        self.by_id: dict[str, Session] = {}
        self.gone: deque[Session] = deque(maxlen=LOST_HISTORY)

    def live(self) -> list[Session]:
        return list(self.by_id.values())

    def producers(self) -> list[ProducerSession]:
        return [p for p in self.by_id.values() if isinstance(p, ProducerSession)]

    def consumers(self) -> list[ConsumerSession]:
        return [p for p in self.by_id.values() if isinstance(p, ConsumerSession)]

    def producer(self, peer_id: str) -> ProducerSession | None:
        p = self.by_id.get(peer_id)
        return p if isinstance(p, ProducerSession) else None

    def instance_taken(self, role: str, instance: str) -> Session | None:
        return next((p for p in self.by_id.values() if p.role == role and p.instance == instance), None)

    def next_id(self, role: str) -> str:
        """The next peer ID of `role` (spent: IDs are never reused)."""
        self._counters[role] += 1
        return f"{role[0]}{self._counters[role]}"

    def add(self, p: Session) -> None:
        self.by_identity[p.identity] = p
        self.by_id[p.id] = p

    def move(self, p: Session, identity: bytes) -> None:
        """Session `p` continues on a new connection (the same process reconnected)."""
        self.by_identity.pop(p.identity, None)
        p.identity = identity
        self.by_identity[identity] = p

    def remove(self, p: Session, state: str, reason: str, wall: float) -> None:
        p.state, p.gone_at, p.gone_reason = state, wall, reason
        self.by_identity.pop(p.identity, None)
        self.by_id.pop(p.id, None)
        self.gone.append(p)

    def next_rank(self, world_size: int) -> int | None:
        """Lowest rank no live consumer holds (a lost rank is taken by the next to join)."""
        held = {p.rank for p in self.consumers()}
        return next((r for r in range(world_size) if r not in held), None)
