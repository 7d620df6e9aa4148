"""Reuse freed large buffers instead of handing them back to the OS (glibc only).

ZeroMQ mallocs every received message. glibc serves any block above 32 MiB (its highest
mmap threshold) with a fresh mmap and unmaps it on free, so every large message pays a
page fault per 4 KiB page on first touch: the broker spent about twice the CPU per GB
relayed at large batches, and a copy into fresh memory is several times slower than into
reused memory (docs/BENCHMARKS.md; bench/reports/2026-11-29-cpu-vm.md).

With mmap off for malloc, one arena (the others are mmap'd heaps of at most 64 MiB, too
small for a batch) and trimming only above 2 GiB of free top-of-heap, a freed message's
memory serves the next one. The cost: the process keeps its high-water mark of memory
(for the broker: about --queue-bytes plus the batches in flight).
"""

from __future__ import annotations

import ctypes
import os

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8


def reuse_freed_memory() -> bool:
    """Apply the policy above; True if it took effect. Call it before any thread starts
    (ZeroMQ's I/O threads included): threads that already have an arena keep it.
    DFLASH_MALLOC_REUSE=0 leaves malloc as it is."""
    if os.environ.get("DFLASH_MALLOC_REUSE", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: musl's mallopt does nothing, macOS has none
    except (OSError, AttributeError):
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in
               ((M_MMAP_MAX, 0), (M_ARENA_MAX, 1), (M_TRIM_THRESHOLD, (1 << 31) - 1)))
