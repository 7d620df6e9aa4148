"""Peer sessions: one per producer or consumer that said `hello` and got `welcome`.

Peer IDs (`p1`, `c1`, ...) are handed out in order and never reused within a run, so a
log line naming `c2` means one process. Instance names are unique among live peers of a
role: two processes claiming the same name would make logs and status ambiguous.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from .dispatch import QueuedBatch
from .liveness import RateMeter, TimeShare

LOST_HISTORY = 32  # lost/left peers kept for the status map


class DuplicateInstance(Exception):
    """A live peer of that role already uses that instance name."""


@dataclass(eq=False)
class Peer:
    id: str
    role: str
    identity: bytes  # ROUTER identity of its control DEALER
    instance: str
    host: str
    pid: int
    gpu: int | None
    config: dict
    joined_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    stats: dict = field(default_factory=dict)
    stats_at: float | None = None
    state: str = "live"  # live | lost | left
    gone_at: float | None = None
    gone_reason: str | None = None
    held: dict = field(default_factory=dict)  # what it held when it went (status map)
    failure: dict | None = None  # why it stopped: its `failed` message, or the broker's refusal (status map)
    curve_key: str | None = None  # the authorised Curve key it joined with (None without Curve)
    # consumer side
    credit: int = 0
    last_served: int = 0
    in_flight: OrderedDict[str, QueuedBatch] = field(default_factory=OrderedDict)
    pipes: list = field(default_factory=list, repr=False)  # one PUSH socket per data stream
    pipe_threads: list[int] = field(default_factory=list)  # each pipe's I/O thread (affinity mask)
    ports: list[int] = field(default_factory=list)
    data_out: str | None = None  # the first stream's endpoint
    data_streams: list[str] = field(default_factory=list)  # every stream's endpoint
    next_stream: int = 0  # the stream the next batch tries first
    rank: int | None = None
    waiting_since: float | None = None  # credit > 0 and nothing to send it
    wait_share: TimeShare = field(default_factory=TimeShare)  # how much of the last 10 s it waited
    delivered: int = 0
    acked: int = 0
    # The ack deadline's clock: the later of its latest ack and the delivery that gave it
    # batches while it held none; and its slowest gap between two acks so far.
    progress_at: float = field(default_factory=time.monotonic)
    slowest_ack_gap: float = 0.0
    # producer side
    batches_in: int = 0
    bytes_in: int = 0
    samples_in: int = 0
    stale: int = 0
    rate_in: RateMeter = field(default_factory=RateMeter)  # batches from / to this peer
    rate_tokens: RateMeter = field(default_factory=RateMeter)

    @property
    def live(self) -> bool:
        return self.state == "live"

    def close_pipes(self) -> None:
        """Close a consumer's data-out sockets (nothing queued in them is waited for)."""
        for sock in self.pipes:
            sock.close(linger=0)
        self.pipes = []

    def describe(self) -> dict[str, Any]:
        """Identity fields for log lines; `peer_*` so they never shadow our own."""
        return {"peer": self.id, "peer_role": self.role, "peer_instance": self.instance,
                "peer_host": self.host, "peer_pid": self.pid, "peer_gpu": self.gpu}


class PeerTable:
    """Live sessions by ROUTER identity and by peer ID, plus a short history of the gone."""

    def __init__(self):
        self._counters = {"producer": 0, "consumer": 0}
        self.by_identity: dict[bytes, Peer] = {}
        self.by_id: dict[str, Peer] = {}
        self.gone: deque[Peer] = deque(maxlen=LOST_HISTORY)

    def live(self, role: str | None = None) -> list[Peer]:
        return [p for p in self.by_id.values() if role is None or p.role == role]

    def instance_taken(self, role: str, instance: str) -> Peer | None:
        return next((p for p in self.live(role) if p.instance == instance), None)

    def add(self, role: str, identity: bytes, hello: dict) -> Peer:
        """Open a session. Raises DuplicateInstance."""
        other = self.instance_taken(role, hello["instance"])
        if other is not None:
            raise DuplicateInstance(
                f"a live {role} is already named {hello['instance']!r} ({other.id} on {other.host}, "
                f"pid {other.pid}); give this one another --instance"
            )
        self._counters[role] += 1
        pid = f"{role[0]}{self._counters[role]}"
        gpu = hello.get("gpu")
        p = Peer(pid, role, identity, hello["instance"], hello["host"], hello["pid"],
                 gpu if isinstance(gpu, int) else None, hello.get("config") or {})
        self.by_identity[identity] = p
        self.by_id[pid] = p
        return p

    def remove(self, p: Peer, state: str, reason: str) -> None:
        p.state, p.gone_at, p.gone_reason = state, time.time(), reason
        self.by_identity.pop(p.identity, None)
        self.by_id.pop(p.id, None)
        self.gone.append(p)

    def next_rank(self, world_size: int) -> int | None:
        """Lowest rank no live consumer holds (a lost rank is taken by the next to join)."""
        held = {p.rank for p in self.live("consumer")}
        return next((r for r in range(world_size) if r not in held), None)
