"""Helpers for status tests: run dflash-status, read its peers."""

from __future__ import annotations

import json
import subprocess
import sys


def status(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.tools.status_command", *args], capture_output=True, text=True,
                          timeout=timeout)


def status_json(*args: str) -> dict:
    r = status(*args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def rows(st: dict, role: str) -> dict:
    return {p["instance"]: p for p in st["peers"] if p["role"] == role}
