"""Lineages: which trained samples a committing checkpoint's weights actually hold
(PROTOCOL.md 4.5, docs/RELIABILITY.md 3).

A **lineage** is one history of weights: a consumer that starts fresh or from a checkpoint
starts a new one (and says so with `lineage {lineage, parent, step}`: it continues
`parent`'s weights as of `step`, or nothing when `parent` is nil); a consumer healed from a
running one, or a rank of the same data-parallel group, shares that one's lineage and sends
it in every `ack` and `commit`. `step` in `ack` and `commit` counts the optimizer steps of
the lineage's weights, a child continuing its parent's count.

A checkpoint of lineage L at step N holds exactly: L's own samples acked at a step <= N,
and, walking up the parents, those of each ancestor acked at a step <= the step its child
forked from it. The broker commits only those (`holds`). When a new lineage starts from a
checkpoint, everything trained that it does not hold goes back to the lease pool (made
and trained again), and the lineages it leaves behind are **superseded**: an ack or commit
from one of them for a step past the fork is refused (`reject lineage_superseded`), so a
consumer still training on weights nobody will keep stops instead of doing work that is
thrown away.

Peers that never name a lineage all share the lineage "" (the step then counts one job's
optimizer steps, as it always did).
"""

from __future__ import annotations

from dataclasses import dataclass

from .dispatch import Queued

DEFAULT = ""  # the lineage of acks and commits that name none
MAX_LINEAGE = 128  # characters of a lineage name kept (peers choose them)


@dataclass
class TrainedBatch:
    """An acked, not yet committed batch (its frames let go): what a commit or a rewind
    needs of it."""

    queued: Queued
    lineage: str
    step: int
    consumer: str


class Lineages:
    def __init__(self):
        self.parent: dict[str, tuple[str | None, int]] = {}  # lineage -> (parent, step it started from)
        self.superseded: dict[str, int] = {}  # lineage -> last step of it that is kept (-1: none)
        self.head: str | None = None  # the newest lineage started
        self.last_commit_lineage: str | None = None

    def known(self, lineage: str) -> bool:
        return lineage in self.parent

    def caps(self, lineage: str, step: int) -> dict[str, int]:
        """lineage -> highest step of it whose samples `lineage`'s weights at `step` hold."""
        out, cur, cap = {}, lineage, step
        while cur is not None and cur not in out:
            out[cur] = cap
            parent, start = self.parent.get(cur, (None, 0))
            cur, cap = parent, min(cap, start)
        return out

    def holds(self, lineage: str, step: int, t: TrainedBatch) -> bool:
        """Do `lineage`'s weights at `step` hold trained batch `t`?"""
        cap = self.caps(lineage, step).get(t.lineage)
        return cap is not None and t.step <= cap

    def refused(self, lineage: str, step: int) -> int | None:
        """The last kept step when an ack or commit of (`lineage`, `step`) comes from
        weights nobody keeps (superseded past that step), else None."""
        last = self.superseded.get(lineage)
        return last if last is not None and step > last else None

    def start(self, lineage: str, parent: str | None, step: int) -> bool:
        """Record that `lineage` starts from `parent` at `step` (None: from nothing).
        Returns False if it was known already (a repeated announcement: nothing changes)."""
        if lineage in self.parent:
            return False
        if parent == lineage:
            parent = None
        self.parent[lineage] = (parent, step)
        self.head = lineage
        keep = self.caps(lineage, step)
        keep.pop(lineage)
        for other in list(self.parent) + [DEFAULT]:
            if other != lineage:  # what the new weights do not hold is thrown away with the old ones
                self.superseded[other] = min(self.superseded.get(other, keep.get(other, -1)), keep.get(other, -1))
        self.superseded.pop(lineage, None)
        return True
