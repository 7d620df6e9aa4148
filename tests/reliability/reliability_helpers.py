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

import msgpack
import zmq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "broker"))

from broker_harness import BrokerProc, spawn_fake  # noqa: E402,F401

from dflash.protocol.curve import client_keys  # noqa: E402

REL_FAKES = str(HERE / "rel_fakes.py")


def spawn(role: str, broker: BrokerProc, *args: str) -> subprocess.Popen:
    """A rel_fakes.py process attached to `broker`."""
    return spawn_fake(role, broker, *args, script=REL_FAKES)


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


def curve_dealer(endpoint: str, keys: Path | None, name: str | None) -> zmq.Socket:
    """A DEALER that is a CURVE client with keypair `name` of `keys` (plain if keys is None)."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        client_keys(keys, name).apply(s)
    s.connect(endpoint)
    return s


def curve_status(endpoint: str, keys: Path | None, name: str | None, timeout_s: float = 2.0) -> dict | None:
    """The broker's status map asked over Curve, or None if it does not answer."""
    s = curve_dealer(endpoint, keys, name)
    try:
        s.send(msgpack.packb({"v": 1, "type": "status"}))
        if s.poll(int(timeout_s * 1000)):
            return msgpack.unpackb(s.recv_multipart()[0], strict_map_key=False)["status"]
        return None
    finally:
        s.close()


class CurveBrokerProc(BrokerProc):
    """A broker started with --curve-keys; its liveness probe speaks Curve as `probe_name`."""

    def __init__(self, runs_dir: Path, args: list[str], keys: Path, probe_name: str, n_out: int = 8):
        self.keys, self.probe_name = keys, probe_name
        super().__init__(runs_dir, ["--curve-keys", str(keys), *args], n_out)

    def ask(self, timeout_s: float = 2.0) -> dict | None:
        return curve_status(self.control, self.keys, self.probe_name, timeout_s)
