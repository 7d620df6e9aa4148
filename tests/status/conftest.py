"""Fixtures for status tests: a real broker process (tests/broker/broker_harness.py) and
stats-reporting wire fakes as processes (status_fakes.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "broker"))
sys.path.insert(0, str(HERE))

from broker_harness import start_broker  # noqa: E402,F401  (the fixture)


@pytest.fixture
def fakes():
    """spawn(role, broker, *args) -> Popen; every process is killed at the end."""
    from status_helpers import spawn

    procs = []

    def start(role, broker, *args):
        p = spawn(role, broker, *args)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(5)
