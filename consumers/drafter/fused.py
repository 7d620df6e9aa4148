"""The drafter step's elementwise work, optionally fused by torch.compile.

RMSNorm (in fp32), RoPE, SwiGLU and the loss's per-chunk softmax arithmetic are memory
bound: run one PyTorch op at a time, each reads and writes whole [Q, D] or [chunk, vocab]
tensors several times. `enable(True)` (dflash-consume `--fuse`) swaps in torch.compile'd
versions of the very same functions (dynamic shapes: Q changes every batch), which read
their inputs once; the loss chunk's is its arithmetic written out of place, the form
inductor fuses into one pass that writes the gradient in the LM head's dtype. Off by default: compiling needs a working inductor toolchain and costs
start-up time. Results agree with the eager versions to rounding (tests/consumers).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 (bf16 sums lose digits), hand back the input dtype so that fp32
    # master weights do not silently promote the bf16 activations under autocast.
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


def ce_chunk(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None, need_grad: bool,
             grad_dtype: torch.dtype | None = None):
    """One chunk of the CE from its raw logits [c, V]: (each row's CE [c], argmax
    predictions, d (sum of w * CE) / d logits in `grad_dtype` (default: the softmax's) or
    None), softmax sums in at least fp32. w None: unit weights (--loss dpace weights the
    rows once every chunk is done)."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    logits = logits.to(acc)
    lse = torch.logsumexp(logits, dim=-1)  # [c]
    picked = logits.gather(1, y[:, None])[:, 0]  # [c]
    rows = lse - picked
    preds = logits.argmax(dim=-1)
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
    """`ce_chunk`'s arithmetic written out of place, the form torch.compile fuses: one pass
    over the logits for the sums, one that writes the gradient straight in `grad_dtype`.
    Compiled, the in-place form costs extra full passes over an fp32 [c, V] tensor (the
    one-hot scatter, the weighting, the cast); eager, this form would hold several."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    z = logits.to(acc)
    lse = torch.logsumexp(z, dim=-1)  # [c]
    picked = z.gather(1, y[:, None])[:, 0]  # [c]
    rows = lse - picked
    preds = z.argmax(dim=-1)
    if not need_grad:
        return rows, preds, None
    onehot = torch.arange(z.shape[1], device=z.device)[None, :] == y[:, None]  # [c, V], never stored compiled
    g = torch.exp(z - lse[:, None]) - onehot.to(acc)
    if w is not None:
        g = g * w[:, None]
    return rows, preds, g if grad_dtype is None else g.to(grad_dtype)


_EAGER: dict[str, Callable] = {"rms_norm": rms_norm, "rope": rope, "swiglu": swiglu, "ce_chunk": ce_chunk}
# What enable(True) compiles, where it is not the eager function itself
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
