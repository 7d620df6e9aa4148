"""GPU figures for heartbeats: memory used/total and utilisation of one device, so `dflash-status`
shows every GPU of the run. NVML when installed, else torch's memory figures only; `{}` when nothing
answers, since a heartbeat must never fail because of its figures.
"""

from __future__ import annotations

import os
from typing import Any

_nvml: dict[str, Any] = {"state": None, "handles": {}}  # state: None (untried), "ok", "off"


def gpu_figures(device: Any) -> dict:
    """{gpu_mem_used, gpu_mem_total, gpu_util (NVML only)} of a CUDA `device`, else {}; never raises."""
    index = _cuda_index(device)
    if index is None:
        return {}
    try:
        handle = _nvml_handle(index)
        if handle is not None:
            import pynvml

            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
            return {"gpu_mem_used": int(mem.used), "gpu_mem_total": int(mem.total), "gpu_util": float(util)}
        import torch

        if not torch.cuda.is_available():
            return {}
        free, total = torch.cuda.mem_get_info(index)
        return {"gpu_mem_used": int(total - free), "gpu_mem_total": int(total)}
    except Exception:  # a driver hiccup must not kill the heartbeat thread
        return {}


def _cuda_index(device: Any) -> int | None:
    if device is None:
        return None
    if isinstance(device, int):
        return device
    text = str(device)  # torch.device("cuda:1") -> "cuda:1"; "cuda" -> the current device
    if not text.startswith("cuda"):
        return None
    if ":" in text:
        return int(text.split(":", 1)[1])
    try:
        import torch

        return torch.cuda.current_device() if torch.cuda.is_available() else None
    except Exception:
        return None


def _nvml_handle(index: int):
    """NVML's handle for CUDA ordinal `index` (matched by UUID: CUDA_VISIBLE_DEVICES renumbers), or None."""
    if _nvml["state"] == "off":
        return None
    if index in _nvml["handles"]:
        return _nvml["handles"][index]
    try:
        import pynvml

        if _nvml["state"] is None:
            pynvml.nvmlInit()
            _nvml["state"] = "ok"
    except Exception:
        _nvml["state"] = "off"  # no NVML here: do not try again every second
        return None
    try:
        handle = _by_uuid(pynvml, index) or _by_visible_index(pynvml, index)
    except Exception:
        handle = None  # this device is unknown to NVML: torch's figures for it
    _nvml["handles"][index] = handle
    return handle


def _by_uuid(pynvml, index: int):
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        return None
    for name in (uuid, f"GPU-{uuid}"):
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(name)
        except Exception:
            continue
    return None


def _by_visible_index(pynvml, index: int):
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    entry = visible[index]
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    return pynvml.nvmlDeviceGetHandleByUUID(entry)


def matmul_ceiling_tflops(device, n: int = 8192, reps: int = 10) -> float:
    """Measured bf16 matrix-product rate of CUDA `device` in TFLOP/s (the benchmarks' MFU denominator)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12
