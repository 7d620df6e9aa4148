"""The tie rule (docs/EVAL.md): where two greedy decodings first differ, and whether the target's
top logits were within rounding there (then the difference is not the decoder's fault)."""

from __future__ import annotations

import torch
from torch import nn


TIE_TOLERANCE = {torch.float32: 0.0, torch.float64: 0.0, torch.bfloat16: 0.5, torch.float16: 0.0625}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ (a shorter one differs at its end); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.inference_mode()
def divergence(model: nn.Module, prompt: list[int], a: list[int], b: list[int]) -> dict | None:
    """First difference of two outputs with top2_margin (top-1 minus top-2 logit) and flip_margin
    (top-1 minus the lower chosen token); margins None for a length-only difference."""
    i = first_difference(a, b)
    if i is None:
        return None
    if i >= min(len(a), len(b)):
        return {"index": i, "tokens": None, "top2_margin": None, "flip_margin": None}
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([prompt + a[:i]], device=device)
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
    top = logits.topk(2).values
    return {"index": i, "tokens": [a[i], b[i]], "top2_margin": float(top[0] - top[1]),
            "flip_margin": float(top[0] - torch.minimum(logits[a[i]], logits[b[i]]))}


def is_tie_flip(div: dict | None, tolerance: float) -> bool:
    """Both tokens within `tolerance` of the best logit at the first difference."""
    return div is not None and div["flip_margin"] is not None and div["flip_margin"] <= tolerance
