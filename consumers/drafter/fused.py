"""The drafter step's elementwise work, optionally fused by torch.compile.

These ops are memory bound; `enable(True)` (`--fuse`) swaps in torch.compile'd versions of the
same functions (dynamic shapes), which read their inputs once. Results agree to rounding."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 statistics, the input dtype back: fp32 master weights must not promote bf16 activations
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, hd]; cos/sin [N, hd] (rotate-half convention)."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _ce_rows(logits: torch.Tensor, y: torch.Tensor):
    """(logits in at least fp32, their logsumexp, each row's CE, argmax) of one chunk."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(z, dim=-1)  # [c]
    return z, lse, lse - z.gather(1, y[:, None])[:, 0], z.argmax(dim=-1)


def ce_chunk(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None, need_grad: bool,
             grad_dtype: torch.dtype | None = None):
    """One chunk of the CE from raw logits: (each row's CE, argmax, d (sum of w * CE) / d logits or None)."""
    logits, lse, rows, preds = _ce_rows(logits, y)
    if not need_grad:
        return rows, preds, None
    # d CE / d logits = softmax - onehot, scaled by the row's weight.
    g = torch.exp(logits.sub_(lse[:, None]))  # in place: softmax [c, V]
    g[torch.arange(g.shape[0], device=g.device), y] -= 1.0
    if w is not None:
        g = g.mul_(w[:, None])
    return rows, preds, g if grad_dtype is None else g.to(grad_dtype)


def ce_chunk_out_of_place(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None, need_grad: bool,
                          grad_dtype: torch.dtype | None = None):
    """`ce_chunk` out of place, the form torch.compile fuses into two passes (the in-place form
    costs extra full passes compiled; this one holds several [c, V] tensors eager)."""
    z, lse, rows, preds = _ce_rows(logits, y)
    if not need_grad:
        return rows, preds, None
    onehot = torch.arange(z.shape[1], device=z.device)[None, :] == y[:, None]  # [c, V], never stored compiled
    g = torch.exp(z - lse[:, None]) - onehot.to(z.dtype)
    if w is not None:
        g = g * w[:, None]
    return rows, preds, g if grad_dtype is None else g.to(grad_dtype)


_EAGER: dict[str, Callable] = {"rms_norm": rms_norm, "rope": rope, "swiglu": swiglu, "ce_chunk": ce_chunk}
_TO_COMPILE: dict[str, Callable] = {"ce_chunk": ce_chunk_out_of_place}
_active: dict[str, Callable] = dict(_EAGER)


def enable(on: bool) -> None:
    """Use torch.compile'd kernels (on) or the eager functions (off) from now on."""
    if not on:
        _active.update(_EAGER)
        return
    for name, fn in _EAGER.items():
        if _active[name] is fn:
            _active[name] = torch.compile(_TO_COMPILE.get(name, fn), dynamic=True)


def enabled() -> bool:
    return _active["rms_norm"] is not rms_norm


def get(name: str) -> Callable:
    return _active[name]
