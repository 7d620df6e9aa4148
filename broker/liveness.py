"""Liveness and pacing: who went silent, when to beat, how fast things move, and how often a noisy
peer may make us log. Every reading takes `now` from its caller, so tests inject a clock."""

from __future__ import annotations

from collections import deque
from typing import Iterable, Protocol


class _Seen(Protocol):
    last_seen: float


def silent(peers: Iterable[_Seen], now: float, timeout_s: float) -> list:
    """Peers with no message for longer than `timeout_s` (any message counts)."""
    return [p for p in peers if now - p.last_seen > timeout_s]


class Every:
    """A periodic timer for the loop: `due(now)` is True once per `period_s`."""

    def __init__(self, period_s: float, now: float):
        self.period = period_s
        self.next = now + period_s

    def due(self, now: float) -> bool:
        if now < self.next:
            return False
        # Skip missed beats instead of bursting to catch up after a stall.
        self.next = max(self.next + self.period, now)
        return True


class RateMeter:
    """Events per second over about the last `window_s`, in bounded memory (one mark per slot)."""

    def __init__(self, window_s: float = 10.0, slots: int = 32):
        self.window = window_s
        self.total = 0
        self._marks: deque[tuple[float, int]] = deque(maxlen=slots)

    def add(self, n: int, now: float) -> None:
        if not self._marks or now - self._marks[-1][0] >= self.window / self._marks.maxlen:
            self._marks.append((now, self.total))
        self.total += n

    def rate(self, now: float) -> float:
        first = next(((t, c) for t, c in self._marks if now - t <= self.window), None)
        if first is None:
            return 0.0
        # At least 1 s of span, so a single event does not read as a huge rate.
        return (self.total - first[1]) / max(now - first[0], 1.0)


class RateLimit:
    """At most `per_s` events per key per second; `allow` -> (allowed, suppressed since). At most
    `max_keys` keys, so a flood of identities cannot grow it."""

    def __init__(self, per_s: float = 5.0, max_keys: int = 1024):
        self.per_s, self.max_keys = per_s, max_keys
        self._state: dict[str, list] = {}  # key -> [window_start, count_in_window, suppressed]

    def allow(self, key: str, now: float) -> tuple[bool, int]:
        st = self._state.get(key)
        if st is None:
            if len(self._state) >= self.max_keys:
                self._state.pop(next(iter(self._state)))
            st = self._state[key] = [now, 0, 0]
        if now - st[0] >= 1.0:
            st[0], st[1] = now, 0
        if st[1] < self.per_s:
            st[1] += 1
            suppressed, st[2] = st[2], 0
            return True, suppressed
        st[2] += 1
        return False, 0


class TimeShare:
    """Fraction of the last `window_s` a condition held; time since the last `update` counts under its state."""

    def __init__(self, now: float, window_s: float = 10.0, slots: int = 20):
        self.window, self.slot = window_s, window_s / slots
        self._slots: deque[list[float]] = deque(maxlen=slots + 1)  # [slot start, seconds held]
        self._t0 = self._last = now
        self._held = False

    def update(self, held: bool, now: float) -> None:
        if self._held and now > self._last:
            if not self._slots or now - self._slots[-1][0] >= self.slot:
                self._slots.append([now, 0.0])
            self._slots[-1][1] += now - self._last
        self._last, self._held = now, held

    def share(self, now: float) -> float:
        held = sum(s for t, s in self._slots if now - t <= self.window)
        if self._held:
            held += max(0.0, now - self._last)  # the stretch since the last update
        span = min(self.window, now - self._t0)
        return min(1.0, held / span) if span > 0 else 0.0


class WallClock:
    """Wall-clock times read off the monotonic `now` the core is given."""

    def __init__(self, wall: float, now: float):
        self.wall0, self.now0 = wall, now

    def at(self, now: float) -> float:
        return self.wall0 + (now - self.now0)
