"""Reading a run's JSON log files: shared by dflash-logs, dflash-status --run and dflash-plot."""

from __future__ import annotations

import heapq
import json
from pathlib import Path
from typing import Iterable, Iterator


def log_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "logs").glob("*.jsonl"))


def read_lines(path: Path) -> Iterator[dict]:
    """Every parseable JSON line of one file; a torn last line (a crash mid-write) is skipped."""
    with open(path, "r", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(ev, dict):
                yield ev


def merged(run_dir: Path) -> Iterator[dict]:
    """All roles' lines in time order (each file is already in time order: a k-way merge)."""
    return heapq.merge(*(read_lines(p) for p in log_files(run_dir)), key=lambda ev: ev.get("ts", ""))


def matches(ev: dict, *, roles=(), instances=(), levels=(), events=()) -> bool:
    if roles and ev.get("role") not in roles:
        return False
    if instances and ev.get("instance") not in instances:
        return False
    if levels and ev.get("level") not in levels:
        return False
    if events and not any(_event_match(ev.get("event", ""), e) for e in events):
        return False
    return True


def _event_match(name: str, pattern: str) -> bool:
    # "train.step" matches exactly; "train" or "train.*" matches the whole family
    pattern = pattern.removesuffix(".*")
    return name == pattern or name.startswith(pattern + ".")


def select(evs: Iterable[dict], event: str) -> list[dict]:
    return [e for e in evs if e.get("event") == event]
