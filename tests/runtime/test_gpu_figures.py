"""runtime/gpu.py: heartbeat GPU figures. On a CPU device (or a machine without CUDA and
NVML) it answers {} and never raises; on a GPU machine the figures match the driver's."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dflash.runtime.gpu import gpu_figures

pytestmark = pytest.mark.unit

HAS_NVML = importlib.util.find_spec("pynvml") is not None


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu"), "meta"])
def test_no_gpu_device_gives_nothing(device):
    assert gpu_figures(device) == {}


@pytest.mark.skipif(torch.cuda.is_available() or HAS_NVML, reason="this machine has CUDA or NVML")
def test_cuda_index_on_a_machine_without_gpus_gives_nothing_and_does_not_raise():
    assert gpu_figures(0) == {} and gpu_figures("cuda:3") == {} and gpu_figures(torch.device("cuda", 1)) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_figures_match_the_driver():
    f = gpu_figures(torch.device("cuda", 0))
    free, total = torch.cuda.mem_get_info(0)
    assert f["gpu_mem_total"] == total and 0 < f["gpu_mem_used"] <= total
    assert abs(f["gpu_mem_used"] - (total - free)) < 2**30  # NVML and CUDA see the same device
    if HAS_NVML:
        assert 0 <= f["gpu_util"] <= 100
    else:
        assert "gpu_util" not in f
