"""Reuse freed large buffers instead of handing them back to the OS (glibc only).

glibc serves large blocks (every big ZeroMQ message) with a fresh mmap and unmaps it on free, so each
pays a page fault per page on first touch. With mmap off, one arena and a high trim threshold, a freed
message's memory serves the next; the cost is keeping the high-water mark of memory.
"""

from __future__ import annotations

import ctypes
import os

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8


def reuse_freed_memory() -> bool:
    """Apply the policy above before any thread starts (threads keep their arena); True if it took
    effect. DFLASH_MALLOC_REUSE=0 leaves malloc as it is."""
    if os.environ.get("DFLASH_MALLOC_REUSE", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: musl's mallopt does nothing, macOS has none
    except (OSError, AttributeError):
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in
               ((M_MMAP_MAX, 0), (M_ARENA_MAX, 1), (M_TRIM_THRESHOLD, (1 << 31) - 1)))
