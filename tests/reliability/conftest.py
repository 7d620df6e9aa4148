"""Fixtures for reliability tests: brokers as processes, killed at the end of each test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "broker"))

from broker_harness import broker_procs  # noqa: E402


@pytest.fixture
def brokers(tmp_path):
    """`brokers(*args, n_out=8, env=None)` starts a broker on free loopback ports under tmp_path/runs."""
    with broker_procs(tmp_path / "runs") as start:
        yield start
