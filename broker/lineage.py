"""Lineages: which trained samples a committing checkpoint's weights actually hold (PROTOCOL.md 4.5).

A lineage is one history of weights, started fresh or from `parent` at `step`. A checkpoint of L
at step N holds L's samples acked at a step <= N and each ancestor's up to the step its child forked
at; lineages a new one leaves behind are superseded, so weights nobody keeps stop training.
"""

from __future__ import annotations

from dataclasses import dataclass

from .dispatch import Queued

DEFAULT = ""  # the lineage of acks and commits that name none
MAX_LINEAGE = 128  # characters of a lineage name kept (peers choose them)


@dataclass
class TrainedBatch:
    """An acked, not yet committed batch: what a commit or a rewind needs of it."""

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
        """The last kept step when (`lineage`, `step`) is superseded, else None."""
        last = self.superseded.get(lineage)
        return last if last is not None and step > last else None

    def start(self, lineage: str, parent: str | None, step: int) -> bool:
        """Record that `lineage` starts from `parent` at `step`; False if it was known already."""
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
