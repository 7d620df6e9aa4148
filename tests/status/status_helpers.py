"""Helpers for status tests: spawn stats fakes, run dflash-status, wait for a condition."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FAKES = str(HERE / "status_fakes.py")
sys.path.insert(0, str(HERE.parent / "broker"))

from broker_harness import spawn_fake  # noqa: E402


def spawn(role: str, broker, *args: str) -> subprocess.Popen:
    # stdout to /dev/null: a fake logs a line per step, and an unread pipe would block it
    return spawn_fake(role, broker, *args, script=FAKES, stdout=subprocess.DEVNULL)


def status(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.tools.status", *args], capture_output=True, text=True,
                          timeout=timeout)


def status_json(*args: str) -> dict:
    r = status(*args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_for(probe, pred, timeout_s: float, every_s: float = 0.1):
    """Call probe() until pred(result) holds; returns that result. AssertionError with
    the last result otherwise."""
    end = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < end:
        last = probe()
        if last is not None and pred(last):
            return last
        time.sleep(every_s)
    raise AssertionError(f"condition not met within {timeout_s}s; last: {json.dumps(last)[:3000] if last else last}")


def rows(st: dict, role: str) -> dict:
    return {p["instance"]: p for p in st["peers"] if p["role"] == role}
