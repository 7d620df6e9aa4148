"""Waiting for a condition with a deadline, in two shapes: a predicate that becomes true,
and a probe whose result passes a test."""

from __future__ import annotations

import json
import time


def wait_until(pred, timeout_s: float, what: str, every_s: float = 0.05):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


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
