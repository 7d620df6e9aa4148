"""Readers of a run's SQLite ledger: the record the exactly-once claims are checked against."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def ledger_rows(run_dir: Path, sql: str, args=()) -> list[tuple]:
    """Rows of `sql` on a run's ledger, opened read-only."""
    db = sqlite3.connect(f"file:{run_dir / 'ledger.sqlite'}?mode=ro", uri=True)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def committed(run_dir: Path) -> list[tuple[int, int]]:
    """(epoch, sample) rows THIS run committed."""
    return ledger_rows(run_dir, "SELECT epoch, sample FROM samples WHERE state='committed'")
