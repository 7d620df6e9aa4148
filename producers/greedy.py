"""Batched greedy decoding for `--regenerate`: a bare loop over the model's forward with a
KV cache, instead of `model.generate()`.

Why not generate(): on an H200 with a Qwen3-0.6B-shaped target (transformers 5.17, bf16,
sdpa), generate() took 104 ms per decode step at batch 16 and 59 ms at batch 64, while
the same decode as a bare loop took 24 ms, which is what one forward costs
(bench/gpu_regen.py, docs/BENCHMARKS.md). The loop does only what greedy needs: argmax of
the last position, per-row stop tokens, left padding through the attention mask.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash.protocol.hf_compat import cache_kwarg, new_cache


@torch.inference_mode()
def greedy_batch(model: nn.Module, prompts: list[list[int]], *, pad_id: int, stop_ids: set[int],
                 max_new_tokens: int, device: torch.device) -> list[list[int]]:
    """Each prompt's greedy continuation: its new IDs up to and including the first stop
    token, or `max_new_tokens` of them. Rows are left padded so that every row's next
    token sits in the last column; a finished row is fed padding (masked out) until all
    are done."""
    if max_new_tokens < 1 or not prompts:
        return [[] for _ in prompts]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)  # [B, W]
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)  # [B, W]
    pos = (att.cumsum(-1) - 1).clamp_min(0)  # padding's positions are masked, any value does
    stops = torch.tensor(sorted(stop_ids), device=device, dtype=ids.dtype)
    cache_kw = {cache_kwarg(model): new_cache(model)}
    out = model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=True, logits_to_keep=1, **cache_kw)
    nxt = out.logits[:, -1].argmax(-1)  # [B]
    done = torch.isin(nxt, stops)
    steps = [nxt]
    pos = pos[:, -1:]
    for _ in range(max_new_tokens - 1):
        if bool(done.all()):  # one sync per step, as generate() has too
            break
        att = torch.cat([att, torch.ones_like(att[:, :1])], dim=1)
        pos = pos + 1
        out = model(input_ids=nxt[:, None], attention_mask=att, position_ids=pos, use_cache=True, logits_to_keep=1,
                    **cache_kw)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), out.logits[:, -1].argmax(-1))
        done |= torch.isin(nxt, stops)
        steps.append(nxt)
    rows = torch.stack(steps, dim=1).tolist()  # [B, n]
    return [until_stop(row, stop_ids) for row in rows]


def until_stop(tokens: list[int], stops: set[int]) -> list[int]:
    """`tokens` up to and including the first stop token (a finished row is padded after it)."""
    end = next((i for i, t in enumerate(tokens) if t in stops), None)
    return tokens if end is None else tokens[: end + 1]
