"""Fixtures for broker tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from broker_harness import start_broker  # noqa: E402,F401  (the fixture)
