"""Greedy speculative decoding with a DFlash drafter (DFLASH.md "Inference"), and plain
greedy decoding with the target alone to compare against. Batch size 1, any Hugging Face
causal LM as the target (tied or untied heads).

One cycle: the bonus token (the target's last choice) plus B-1 MASKs go through the
drafter, conditioned on the target features of every token accepted so far; the target
verifies the block in one forward pass and keeps the longest prefix of drafts that equals
its own argmax, plus its own next token (the new bonus). Output is therefore exactly the
target's greedy output, only produced in fewer target passes.

Correctness first: the drafter's context is recomputed from the stored features of all
accepted tokens every cycle (fc + k/v projections over the whole context), where an
engine would keep it as a draft KV cache. The target keeps a normal KV cache, cropped to
the accepted tokens after each verification.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash.protocol.hf_compat import cache_kwarg, new_cache

from .blocks import build_layout
from .export import Drafter
from .target_heads import embed_block


@dataclass
class Generation:
    tokens: list[int]  # new tokens only; ends at the first stop token or at max_new_tokens
    seconds: float
    accept_lengths: list[int] = field(default_factory=list)  # per cycle: tokens committed, bonus included
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the target agreed with

    @property
    def target_passes(self) -> int:
        return 1 + len(self.accept_lengths)  # prefill + one verification per cycle


def _crop(cache, length: int) -> None:
    # crop(-n) removes n tokens in transformers 4.x and 5.x alike; crop(0) would empty a
    # 4.x cache, hence the guard.
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _target_step(model: nn.Module, ids: torch.Tensor, start: int, cache, layer_ids: list[int] | None,
                 last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [T] at positions start.. -> (logits [T or 1, V], features [T, n*D] or None).

    Feature of layer i = hidden_states[i + 1]: the output of decoder layer i (DFLASH.md)."""
    pos = torch.arange(start, start + ids.numel(), device=ids.device)
    out = model(input_ids=ids[None], position_ids=pos[None], use_cache=True, **{cache_kwarg(model): cache},
                output_hidden_states=layer_ids is not None, logits_to_keep=1 if last_only else 0)
    feats = None
    if layer_ids is not None:
        feats = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)  # [T, n*D]
    return out.logits[0], feats


@torch.inference_mode()
def greedy(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, stop_ids: set[int]) -> Generation:
    """Target-only greedy decoding with a KV cache, one token per forward pass."""
    t0 = time.perf_counter()
    cache = new_cache(model)
    logits, _ = _target_step(model, prompt, 0, cache, None, last_only=True)
    out = [int(logits[-1].argmax())]
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        logits, _ = _target_step(model, torch.tensor([out[-1]], device=prompt.device),
                                 prompt.numel() + len(out) - 1, cache, None, last_only=True)
        out.append(int(logits[-1].argmax()))
    return Generation(out, time.perf_counter() - t0)


def propose(drafter: Drafter, embed: nn.Module | torch.Tensor, lm_head: torch.Tensor, context: torch.Tensor,
            bonus: int, size: int) -> list[int]:
    """size-1 draft tokens for the positions after `bonus`.

    context [T, n*D]: target features of the T accepted tokens (positions 0..T-1); the bonus
    sits at position T. The block sees all of the context (it lies before the anchor)."""
    T, device = context.shape[0], context.device
    ids = torch.tensor([bonus] + [drafter.mask_token_id] * (size - 1), device=device)  # [size]
    x = embed_block(ids, embed).to(next(drafter.model.parameters()).dtype)  # [size, D], as the target embeds them
    layout = build_layout([T], [torch.tensor([T])], size, device)
    h = drafter.model(context.to(x.dtype), x, layout)  # [size, D]
    return (h[1:] @ lm_head.T.to(h.dtype)).argmax(-1).tolist()  # position 0 is the given bonus


@torch.inference_mode()
def speculative_greedy(model: nn.Module, drafter: Drafter, prompt: torch.Tensor, max_new_tokens: int,
                       stop_ids: set[int]) -> Generation:
    """Greedy decoding of `prompt` [P] with draft/verify cycles (see the module docstring)."""
    t0 = time.perf_counter()
    embed = model.get_input_embeddings()  # the module, as engines call it (Gemma scales its rows)
    lm_head = model.get_output_embeddings().weight  # [V, D]; the same tensor when tied
    layers = drafter.target_layer_ids
    cache = new_cache(model)
    P = prompt.numel()
    logits, context = _target_step(model, prompt, 0, cache, layers, last_only=True)  # context [P, n*D]
    gen = Generation([int(logits[-1].argmax())], 0.0)
    while len(gen.tokens) < max_new_tokens and gen.tokens[-1] not in stop_ids:
        start = P + len(gen.tokens) - 1  # position of the bonus token
        size = min(drafter.block_size, max_new_tokens - len(gen.tokens))  # a cycle commits <= size tokens
        drafts = propose(drafter, embed, lm_head, context, gen.tokens[-1], size) if size > 1 else []
        block = torch.tensor([gen.tokens[-1]] + drafts, device=prompt.device)  # [size]
        logits, feats = _target_step(model, block, start, cache, layers)  # [size, V], [size, n*D]
        choice = logits.argmax(-1).tolist()  # the target's next token after each block position
        n = 0
        while n < len(drafts) and drafts[n] == choice[n]:
            n += 1
        _crop(cache, start + n + 1)  # keep the bonus and the accepted drafts, drop the rest
        context = torch.cat([context, feats[: n + 1]])  # their features join the drafter's context
        gen.accept_lengths.append(n + 1)
        gen.drafted += len(drafts)
        gen.accepted += n
        new = drafts[:n] + [choice[n]]
        stop = next((i for i, t in enumerate(new) if t in stop_ids), None)
        gen.tokens += new if stop is None else new[: stop + 1]
    gen.seconds = time.perf_counter() - t0
    return gen
