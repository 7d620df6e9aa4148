"""Exactly-once, read from what a chain of runs left on disk: each run's ledger (the
broker's account) and the final checkpoint's record of what its weights were trained on
(consumers/checkpoints/record.py, the training loop's own account). The two are independent: the
ledger is written by the broker from acks and commits, the record by the consumers from
the batches they stepped on.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


def _rows(run_dir: Path, sql: str) -> list[tuple]:
    db = sqlite3.connect(f"file:{run_dir / 'ledger.sqlite'}?mode=ro", uri=True)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


@dataclass
class Audit:
    expected: set[tuple[int, int]]
    ledger: Counter = field(default_factory=Counter)  # (epoch, sample) -> runs that committed it
    record: Counter = field(default_factory=Counter)  # (epoch, sample) -> times in the final weights
    inherited_ok: bool = True
    final_checkpoint: Path | None = None
    record_complete: bool = False

    @property
    def lost(self) -> set:
        """Expected pairs missing from the committed ledger or from the final weights."""
        return (self.expected - set(self.ledger)) | (self.expected - set(self.record))

    @property
    def duplicated(self) -> set:
        """Pairs committed by two runs, or trained more than once into the final weights."""
        return {k for k, n in self.ledger.items() if n > 1} | {k for k, n in self.record.items() if n > 1}

    @property
    def unexpected(self) -> set:
        return (set(self.ledger) | set(self.record)) - self.expected


def final_commit(runs: Path, chain: list[str]) -> tuple[str, int, str] | None:
    """(run, step, checkpoint) of the newest commit of the chain."""
    for run in reversed(chain):
        row = _rows(runs / run, "SELECT step, checkpoint FROM commits ORDER BY ts DESC, rowid DESC LIMIT 1")
        if row:
            return run, row[0][0], row[0][1]
    return None


def audit(runs: Path, chain: list[str], epochs: int, n: int) -> Audit:
    from dflash.consumers.checkpoints.record import TrainedRecord

    a = Audit({(e, s) for e in range(epochs) for s in range(n)})
    before: set = set()
    for run in chain:
        own = _rows(runs / run, "SELECT epoch, sample FROM samples WHERE state='committed'")
        inherited = set(_rows(runs / run, "SELECT epoch, sample FROM inherited"))
        a.inherited_ok &= inherited == before  # each run starts from exactly what its parents committed
        a.ledger.update(own)
        before |= set(own) | inherited
    last = final_commit(runs, chain)
    if last is not None:
        a.final_checkpoint = Path(last[2])
        rec = TrainedRecord.load(a.final_checkpoint)
        if rec is not None:
            a.record_complete = rec.complete
            for e, counts in rec.epochs.items():
                a.record.update({(e, s): c for s, c in enumerate(counts) if c})
    return a
