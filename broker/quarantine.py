"""Poison batches: batches the run cannot use, and what becomes of their samples (docs/RELIABILITY.md).

A misfit batch is refused at intake, its samples left in their lease. A batch --quarantine-after
consumers fail on is quarantined: its samples are made once more, then set aside for good, so one
batch cannot block a run and no sample is dropped uncounted.
"""

from __future__ import annotations

from collections import Counter

# Quarantines of a sample's batch before it is set aside: the first bad copy need not be the producer's fault.
REMAKES = 1


class Poison:
    """Bad batches so far: counts by action and fault, and quarantines per sample."""

    def __init__(self, quarantine_after: int):
        self.quarantine_after = quarantine_after
        self.tries: Counter[tuple[int, int]] = Counter()  # (epoch, sample) -> times quarantined
        # action ("rejected", "quarantined") -> fault -> {"batches", "samples", "remade", "set_aside"}
        self.counts: dict[str, dict[str, dict[str, int]]] = {}

    def count(self, action: str, fault: str, samples: int, remade: int = 0, aside: int = 0) -> None:
        row = self.counts.setdefault(action, {}).setdefault(
            fault, {"batches": 0, "samples": 0} | ({"remade": 0, "set_aside": 0} if action == "quarantined" else {}))
        row["batches"] += 1
        row["samples"] += samples
        if action == "quarantined":
            row["remade"] += remade
            row["set_aside"] += aside

    def split(self, epoch: int, samples: list[int]) -> tuple[list[int], list[int]]:
        """(samples to make again, samples to set aside) of a batch being quarantined."""
        remade, aside = [], []
        for s in samples:
            self.tries[epoch, s] += 1
            (remade if self.tries[epoch, s] <= REMAKES else aside).append(s)
        return remade, aside

    def as_dict(self) -> dict:
        return {action: {fault: dict(row) for fault, row in faults.items()} for action, faults in self.counts.items()}
