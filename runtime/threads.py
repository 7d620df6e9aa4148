"""Name the OS thread, so `top -H`, `py-spy` and the benchmarks' per-thread CPU columns
can tell our threads apart (Python's own thread names never reach the kernel)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_PR_SET_NAME = 15
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None


def name_this_thread(name: str) -> None:
    """Set the calling thread's kernel name (Linux keeps 15 bytes); elsewhere do nothing."""
    if _libc is not None:
        _libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
