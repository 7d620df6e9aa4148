"""Fixtures for reliability tests: brokers as processes, killed at the end of each test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability_helpers import BrokerProc  # noqa: E402


@pytest.fixture
def brokers(tmp_path):
    """`brokers(*args)` starts a broker on free loopback ports under tmp_path/runs."""
    started: list[BrokerProc] = []

    def start(*args: str, n_out: int = 8, env: dict | None = None) -> BrokerProc:
        b = BrokerProc(tmp_path / "runs", list(args), n_out, env=env)
        started.append(b)
        return b

    yield start
    for b in started:
        if b.proc.poll() is None:
            b.proc.kill()
            b.proc.wait(5)
