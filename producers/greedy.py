"""Batched greedy decoding for `--regenerate`, kept as the function earlier callers use:
it now runs on the decoding core (decoding/: static KV cache, CUDA-graph decode
step on a GPU, continuous batching), which replaced the bare loop over the model's forward
with a transformers DynamicCache that was here.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash.decoding.greedy import greedy_generate


def greedy_batch(model: nn.Module, prompts: list[list[int]], *, pad_id: int, stop_ids: set[int],
                 max_new_tokens: int, device: torch.device | None = None) -> list[list[int]]:
    """Each prompt's greedy continuation: its new IDs up to and including the first stop
    token, or `max_new_tokens` of them. All prompts decode side by side. `pad_id` and
    `device` are accepted for the old callers: padding is masked (any ID does) and the
    model's own device is used."""
    if max_new_tokens < 1 or not prompts:
        return [[] for _ in prompts]
    return greedy_generate(model, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                           batch_size=len(prompts))
