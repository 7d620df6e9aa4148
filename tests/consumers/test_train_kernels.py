"""`--attn auto` / `--fuse auto`: the compiled kernels (flex attention, fused elementwise) on a
GPU that can build them; the eager ones on CPU, and on a GPU host with no C compiler for
Triton's launcher, which would otherwise fail at the first step."""

from __future__ import annotations

import torch
from structlog.testing import capture_logs

from dflash.consumers.training.train import auto_compiles
import pytest

pytestmark = pytest.mark.unit

CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it


def test_cpu_never_takes_the_compiled_kernels(monkeypatch):
    monkeypatch.setenv("CC", "/usr/bin/cc")
    assert auto_compiles(torch.device("cpu")) is False


def test_a_gpu_with_a_compiler_takes_them(monkeypatch):
    monkeypatch.setenv("CC", "/opt/any/cc")
    with capture_logs() as logs:
        assert auto_compiles(CUDA) is True
    assert logs == []


def test_a_gpu_without_a_compiler_falls_back_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no cc, gcc or clang
    with capture_logs() as logs:
        assert auto_compiles(CUDA) is False
    (warn,) = logs
    assert warn["event"] == "train.compile_unavailable" and warn["log_level"] == "warning"
    assert warn["attn"] == "sdpa" and warn["fuse"] == "off" and "C compiler" in warn["hint"]
