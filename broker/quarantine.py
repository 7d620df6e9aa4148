"""Poison batches: batches the run cannot use, and what becomes of their samples.

A batch is bad in one of two ways (docs/RELIABILITY.md, "Poison batches"):

- It does not fit the run's target (fit.py): refused at intake (`rejected`), never queued.
  Its samples were never received, so they stay in their lease: the producer's correct
  copy is still accepted, and a lease that never gets one goes back to the pool.
- Consumers fail on it in a way the broker cannot see: each one that does says so
  (`failed {code: bad_batch, batch_id}`, PROTOCOL.md 4.2) and leaves; the batch goes back
  to the front of the queue for the next consumer. After `--quarantine-after` reports it is
  taken out (`quarantined`) and never delivered again. Its samples go back to the lease
  pool to be made once more (the bad copy may be a liar's, or corrupt in transit, while the
  producer's own copy was dropped as stale); a sample whose new batch is quarantined too is
  set aside for good (ledger state `quarantined`, with the reason). So one batch cannot
  block a run, and no sample is dropped without a count or trained twice.

`Poison` keeps the counts by fault (status map `bad_batches`, run.json, the ledger's
`bad_batches` table) and how often each sample was quarantined; intake.py refuses, and
delivery.py quarantines, by its rule.
"""

from __future__ import annotations

from collections import Counter

# How often a sample's batch may be quarantined before the sample is set aside: once made
# again, since the first bad copy need not be the producer's fault.
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
