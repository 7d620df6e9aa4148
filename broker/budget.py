"""--time-budget: a run that ends when the user's time ends (docs/TRAINING.md "A recipe for a time budget").

planned = done + rate x (time left - reserve), never below what is leased (a lease is not taken
back), never above the dataset; nothing is leased past the plan and consumers anneal their lr
over it. Before a pace is known (warm-up) the pool leases at most `lead` ahead of what is done.
Pure arithmetic: every call takes `now` from its caller.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass

# Re-plan at most this often; a shorter budget re-plans every tenth of itself (at least 1 s).
EVERY_MAX_S = 30.0
EVERY_MIN_S = 1.0
# The reserve for the end (final checkpoint, commit, export): a twentieth of the budget, within these.
RESERVE_MIN_S, RESERVE_MAX_S = 5.0, 120.0
# The pace a plan is made from: samples trained over at least this long (or since the first)
RATE_WINDOW_S = 60.0

_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?")


def parse_duration(text: str | float | int) -> float:
    """'600', '600s', '10m', '1h30m', '1h2m3s' -> seconds; ValueError names the accepted forms."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        s = str(text).strip().lower()
        if re.fullmatch(r"\d+(?:\.\d+)?", s):
            seconds = float(s)
        else:
            m = _DURATION.fullmatch(s)
            if not s or m is None or not any(m.groups()):
                raise ValueError(f"{text!r} is not a duration: use seconds (600), or h/m/s parts such as "
                                 "600s, 10m, 1h30m")
            h, mi, se = (float(g) if g else 0.0 for g in m.groups())
            seconds = 3600 * h + 60 * mi + se
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise ValueError(f"{text!r}: a time budget must be a positive, finite duration")
    return seconds


def every_for(budget_s: float) -> float:
    return min(EVERY_MAX_S, max(EVERY_MIN_S, budget_s / 10))


def reserve_for(budget_s: float) -> float:
    return min(RESERVE_MAX_S, max(RESERVE_MIN_S, budget_s / 20))


@dataclass(frozen=True)
class PlanFigures:
    """One plan, as broker.plan logs it and the status map shows it."""

    planned_samples: int
    done: int  # samples.done when planned
    leased: int  # samples this run leased or inherited: the plan's floor
    rate: float  # samples trained per second (the rate's window)
    elapsed_s: float
    left_s: float  # until the deadline (the reserve included)
    reason: str  # rate | stalled | deadline | dataset | drained


class Budget:
    """The plan of a run with --time-budget. `started`: the broker's start (monotonic)."""

    def __init__(self, budget_s: float, started: float, reserve_s: float | None = None,
                 every_s: float | None = None):
        self.budget_s, self.started = float(budget_s), started
        self.deadline = started + self.budget_s
        self.reserve_s = reserve_for(self.budget_s) if reserve_s is None else float(reserve_s)
        self.every_s = every_for(self.budget_s) if every_s is None else float(every_s)
        self.first_trained_at: float | None = None
        self.next_at: float | None = None  # the next re-plan (None: warm-up, no sample trained yet)
        self.last: PlanFigures | None = None  # None: warm-up
        self.count = 0  # samples trained so far, as last observed
        self.high = 0.0  # the schedule progress told so far (progress never falls)
        self.count_at_plan = 0  # `count` when the last plan was made
        # samples.done and the dataset's size: a dataset trained before the deadline ends the schedule too
        self.dataset_done, self.dataset_total = 0, 0
        # (time, trained) about once a second: a burst of acks after a stall must not read as a fast pace
        self.marks: deque[tuple[float, int]] = deque()

    @property
    def planned(self) -> int | None:
        return self.last.planned_samples if self.last is not None else None

    def observe(self, now: float, trained: int) -> None:
        """`trained`: samples trained so far (never falls); the first one starts the warm-up's clock."""
        if self.first_trained_at is None:
            if trained <= 0:
                return
            self.first_trained_at, self.next_at = now, now + self.every_s
            # the first acks are not in the pace: how long they took is not known
            self.marks.append((now, trained))
        if now - self.marks[-1][0] >= 1.0:
            self.marks.append((now, trained))
        while len(self.marks) > 1 and self.marks[1][0] <= now - RATE_WINDOW_S:
            self.marks.popleft()  # one mark at or before the window's start stays
        self.count = trained

    def rate(self, now: float) -> float:
        """Samples trained per second since the oldest mark; 0 before any."""
        if not self.marks or now <= self.marks[0][0]:
            return 0.0
        return max(0, self.count - self.marks[0][1]) / (now - self.marks[0][0])

    def due(self, now: float) -> bool:
        """A re-plan is due; in the warm-up also once the reserve begins (too late to measure a pace)."""
        if self.last is None and now >= self.deadline - self.reserve_s:
            return True
        return self.next_at is not None and now >= self.next_at

    def plan(self, now: float, *, done: int, leased: int, total: int, rate: float, reason: str | None = None) -> PlanFigures:
        """Plan from `rate` samples/s; `leased` is the least the plan can be, `total` the most."""
        left = self.deadline - now
        room = max(0.0, left - self.reserve_s)
        rate = max(0.0, rate)
        want = done + int(rate * room)
        planned = min(total, max(leased, want))
        if reason is None:
            reason = ("dataset" if planned >= total else "deadline" if room <= 0
                      else "stalled" if rate <= 0 else "rate")
        self.last = PlanFigures(planned, done, leased, round(rate, 3), round(now - self.started, 3), round(left, 3),
                                reason)
        self.next_at = now + self.every_s
        self.count_at_plan = self.count
        return self.last

    def _share(self, t: float) -> float:
        """The share of the training window (first sample trained to deadline less reserve) gone at `t`."""
        window = self.deadline - self.reserve_s - self.first_trained_at
        return 1.0 if window <= 0 else min(1.0, max(0.0, (t - self.first_trained_at) / window))

    def progress(self, now: float) -> float:
        """The consumers' schedule progress, 0..1, never falling: the share of the window gone, or more
        once the last plan is made or the dataset nears its end (not samples over the plan: an early,
        slow plan would leave the rest of the run at min-lr)."""
        if self.first_trained_at is None:
            return 0.0
        p = self._share(now)
        last = self.last
        if last is not None and last.planned_samples > last.done and last.left_s - self.reserve_s <= self.every_s:
            p0 = self._share(self.started + last.elapsed_s)
            trained = self.count - self.count_at_plan  # since the plan was made, in the plan's samples
            p = max(p, p0 + trained / (last.planned_samples - last.done) * (1.0 - p0))
        if self.dataset_total > 0:
            p = max(p, self.dataset_done / self.dataset_total)
        self.high = max(self.high, min(1.0, p))
        return self.high

    def lease_limit(self, done: int, lead: int) -> int | None:
        """The most samples that may be leased now: the plan, or in the warm-up `lead` ahead of done."""
        if self.last is not None:
            return self.last.planned_samples
        return done + max(1, lead)

    def final(self, total: int) -> bool:
        """The plan is the dataset's: it cannot grow, so producers may be told the end."""
        return self.last is not None and self.last.planned_samples >= total

    def eta_s(self, now: float, done: int, total: int | None, rate: float) -> float | None:
        """Seconds until the plan is trained; None when stalled or nothing is planned."""
        target = self.planned if self.planned is not None else total
        if target is None or rate <= 0:
            return None
        return max(0, target - done) / rate

    def as_dict(self, now: float) -> dict:
        """The status map's `budget`."""
        last = self.last
        return {"budget_s": self.budget_s, "elapsed_s": round(now - self.started, 3),
                "left_s": round(self.deadline - now, 3), "reserve_s": self.reserve_s, "every_s": self.every_s,
                "state": "warmup" if last is None else "planned",
                "planned_samples": None if last is None else last.planned_samples,
                "rate": None if last is None else last.rate, "reason": None if last is None else last.reason,
                "planned_at_s": None if last is None else last.elapsed_s}
