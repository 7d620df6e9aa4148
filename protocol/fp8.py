"""Optional fp8 wire encoding of hidden states (`hidden_encoding: fp8_e4m3_rowscale`).

Each row of each layer's slice gets a float32 scale mapping its largest magnitude to E4M3's top
(value = fp8 * scale): half the bytes of bf16. torch is imported only where a tensor is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ENCODING = "fp8_e4m3_rowscale"  # the batch header's `hidden_encoding` of fp8 hidden states

# Dequantised this many rows at a time: a whole batch's float32 temporaries would crowd a running step.
FP8_DECODE_ROWS = 2048


def encode_fp8(hidden: torch.Tensor, n_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, n*H] float -> (fp8 [T, n*H], float32 scale [T, n]). Raises ValueError on bad shapes."""
    import torch

    fp8 = torch.float8_e4m3fn
    top = torch.finfo(fp8).max  # 448
    T, width = hidden.shape
    if width % n_layers:
        raise ValueError(f"hidden width {width} is not a multiple of {n_layers} layers")
    x = hidden.float().view(T, n_layers, width // n_layers)  # [T, n, H]
    amax = x.abs().amax(dim=-1, keepdim=True)  # [T, n, 1]
    scale = (amax / top).clamp_min(torch.finfo(torch.float32).tiny)
    q = (x / scale).clamp(-top, top).to(fp8)
    return q.view(T, width), scale.view(T, n_layers)


def decode_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(fp8 [T, n*H], float32 [T, n]) -> [T, n*H] in `dtype` (bfloat16 if None)."""
    import torch

    T, width = q.shape
    n = scale.shape[1]
    x = q.float().view(T, n, width // n) * scale.view(T, n, 1)
    return x.view(T, width).to(dtype or torch.bfloat16)
