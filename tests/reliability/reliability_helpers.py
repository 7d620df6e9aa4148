"""Shared by the reliability tests: the broker harness of tests/broker, the process fakes
of rel_fakes.py, and readers of ledgers (the record the exactly-once claims are checked
against). Not conftest.py: several folders have one, and `from conftest import` is
ambiguous."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "broker"))

from broker_harness import BrokerProc  # noqa: E402,F401

REL_FAKES = str(HERE / "rel_fakes.py")


def spawn(role: str, broker: BrokerProc, *args: str) -> subprocess.Popen:
    """A rel_fakes.py process attached to `broker`."""
    return subprocess.Popen([sys.executable, REL_FAKES, role, "--broker", broker.control, "--runs-dir",
                             str(broker.runs_dir), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(procs: list[subprocess.Popen], timeout_s: float = 60.0) -> list[int]:
    """Wait for every process (killing stragglers at the deadline); their exit codes."""
    end = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        p.output = (out or "") + (err or "")  # for assertion messages
        codes.append(p.returncode)
    return codes


def rss_kib(pid: int) -> int:
    """VmRSS of a live process, KiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


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


def wait_until(pred, timeout_s: float, what: str, every_s: float = 0.05):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
