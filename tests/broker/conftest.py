"""Fixtures for broker tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from broker_harness import BrokerProc  # noqa: E402


@pytest.fixture
def start_broker(tmp_path):
    started: list[BrokerProc] = []

    def start(*args: str, n_out: int = 8) -> BrokerProc:
        b = BrokerProc(tmp_path / "runs", list(args), n_out)
        started.append(b)
        return b

    yield start
    for b in started:
        if b.proc.poll() is None:
            b.proc.kill()
            b.proc.wait(5)
