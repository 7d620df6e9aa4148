"""What an out-of-memory log line says about memory (asked for, free, total), for producers and
consumers alike: the same fields, filled or nil, on a CUDA or CPU device.
"""

from __future__ import annotations

import gc
import os
import re

import torch

_ASKED = re.compile(r"Tried to allocate ([\d.]+) ([KMGT]i?B)")  # CUDA's caching allocator
_ASKED_BYTES = re.compile(r"tried to allocate (\d+) bytes")  # the CPU allocator
_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
          "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}


def bytes_asked(err: BaseException) -> int | None:
    """The allocation size in torch's OOM message, CUDA's or the CPU allocator's, if any."""
    m = _ASKED.search(str(err))
    if m:
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    m = _ASKED_BYTES.search(str(err))
    return int(m.group(1)) if m else None


def bytes_free(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def memory_figures(device: torch.device) -> dict:
    """{bytes_free, bytes_total, bytes_allocated, bytes_peak} of `device`; nil where it cannot say."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {"bytes_free": int(free), "bytes_total": int(total),
                "bytes_allocated": int(torch.cuda.memory_allocated(device)),
                "bytes_peak": int(torch.cuda.max_memory_allocated(device))}
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        total = None
    return {"bytes_free": bytes_free(device), "bytes_total": total, "bytes_allocated": None, "bytes_peak": None}


def release(device: torch.device) -> None:
    """Give a failed pass's memory back; call it outside the `except` block, whose traceback holds the frames."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
