"""Greedy speculative decoding with a DFlash drafter, and plain greedy decoding with the
target alone to compare against, both on the decoding core (decoding/). Batch size 1.

The target verifies each drafted block in one pass and keeps the prefix equal to its argmax,
so the output is exactly its greedy output. Both caches are static and indexed by position, so
rejecting drafts only moves a length; a whole cycle is one CUDA graph on a GPU."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dflash.consumers.drafter.model import apply_rope
from dflash.consumers.export.export import Drafter
from dflash.decoding.core import Core
from dflash.decoding.greedy import GreedyDecoder
from dflash.runtime.hf_compat import cache_kwarg
from dflash.runtime.target_heads import embed_block


@dataclass
class Generation:
    tokens: list[int]  # new tokens only; ends at the first stop token or at max_new_tokens
    seconds: float
    accept_lengths: list[int] = field(default_factory=list)  # per cycle: tokens committed, bonus included
    drafted: int = 0  # for positions a cycle could commit
    accepted: int = 0
    passes: int | None = None  # target forwards, where not 1 + cycles (target-only decoding)

    @property
    def target_passes(self) -> int:
        return self.passes if self.passes is not None else 1 + len(self.accept_lengths)


def _target_step(model: nn.Module, ids: torch.Tensor, start: int, cache, layer_ids: list[int] | None,
                 last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' own forward (no core): the reference the core's features are checked against."""
    pos = torch.arange(start, start + ids.numel(), device=ids.device)
    out = model(input_ids=ids[None], position_ids=pos[None], use_cache=True, **{cache_kwarg(model): cache},
                output_hidden_states=layer_ids is not None, logits_to_keep=1 if last_only else 0)
    feats = None
    if layer_ids is not None:
        feats = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)  # [T, n*D]
    return out.logits[0], feats


# ---------------------------------------------------------------- the drafter's cache


class DraftCache:
    """The drafter's context K/V by position, and the block proposal over it (tests hold it equal
    to the training path's DFlashDraft.forward)."""

    def __init__(self, drafter: Drafter, slots: int, device: torch.device):
        m = drafter.model
        self.m, self.cfg, self.slots = m, m.cfg, slots
        self.B, self.mask_id = drafter.block_size, drafter.mask_token_id
        self.dtype = next(m.parameters()).dtype
        c = self.cfg
        shape = (c.num_key_value_heads, slots, c.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in m.layers]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in m.layers]
        self._slot = torch.arange(slots, device=device)
        self._blk = torch.arange(self.B, device=device)
        self._masks = torch.full((self.B - 1,), self.mask_id, dtype=torch.long, device=device)

    def extend(self, feats: torch.Tensor, start: torch.Tensor) -> None:
        """Store the context K/V of the target features of positions start..; past the end dropped."""
        n, c = feats.shape[0], self.cfg
        pos = start + torch.arange(n, device=feats.device)
        ctx = self.m.context(feats.to(self.dtype))  # [n, D]
        cos, sin = self.m.rotary(pos)
        keep = pos < self.slots
        idx = pos.clamp_max(self.slots - 1)
        for layer, K, V in zip(self.m.layers, self.k, self.v):
            a = layer.self_attn
            k = apply_rope(a.k_norm(a.k_proj(ctx).view(n, c.num_key_value_heads, c.head_dim)), cos, sin)
            v = a.v_proj(ctx).view(n, c.num_key_value_heads, c.head_dim)
            # Out-of-range positions rewrite the last slot with its own value: fixed shapes, no branch.
            K[:, idx] = torch.where(keep[None, :, None], k.to(K.dtype).transpose(0, 1), K[:, idx])
            V[:, idx] = torch.where(keep[None, :, None], v.to(V.dtype).transpose(0, 1), V[:, idx])

    def propose(self, bonus: torch.Tensor, start: torch.Tensor, embed: torch.Tensor | nn.Module,
                lm_head: torch.Tensor) -> torch.Tensor:
        """B-1 draft tokens after `bonus` at position `start`, over context slots before it."""
        ids = torch.cat([bonus, self._masks])  # [B]
        x = embed_block(ids, embed).to(self.dtype)  # [B, D]: what the target's embedding module gives
        h = self.block_states(x, start)
        return (h[1:] @ lm_head.T.to(h.dtype)).argmax(-1)  # position 0 is the given bonus

    def block_states(self, x: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Final-normed states [B, D] of a block's input embeddings at positions start.."""
        m, c, B = self.m, self.cfg, self.B
        cos, sin = m.rotary(start + self._blk)
        vis = torch.cat([self._slot < start, torch.ones(B, dtype=torch.bool, device=x.device)])
        mask = vis[None, None, None, :].expand(1, 1, B, self.slots + B)
        Hq, Hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        for layer, K, V in zip(m.layers, self.k, self.v):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = apply_rope(a.q_norm(a.q_proj(h).view(B, Hq, hd)), cos, sin)
            k = apply_rope(a.k_norm(a.k_proj(h).view(B, Hkv, hd)), cos, sin)
            v = a.v_proj(h).view(B, Hkv, hd)
            q, k = q.to(v.dtype), k.to(v.dtype)
            keys = torch.cat([K, k.transpose(0, 1)], dim=1)[None]  # [1, Hkv, slots + B, hd]
            vals = torch.cat([V, v.transpose(0, 1)], dim=1)[None]
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, vals, attn_mask=mask,
                                               scale=hd**-0.5, enable_gqa=True)  # [1, Hq, B, hd]
            x = x + a.o_proj(o[0].transpose(0, 1).reshape(B, Hq * hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.norm(x)


@torch.inference_mode()
def propose(drafter: Drafter, embed: torch.Tensor | nn.Module, lm_head: torch.Tensor, context: torch.Tensor, bonus: int,
            size: int) -> list[int]:
    """size-1 draft tokens after `bonus` (at position T), given the features of T accepted tokens."""
    if size != drafter.block_size:
        raise ValueError(f"blocks are always {drafter.block_size} wide (as trained), not {size}")
    T, device = context.shape[0], context.device
    cache = DraftCache(drafter, T + 1, device)
    start = torch.tensor([T], device=device)
    cache.extend(context, torch.zeros(1, dtype=torch.long, device=device))
    return cache.propose(torch.tensor([bonus], device=device), start, embed, lm_head).tolist()


# ---------------------------------------------------------------- decoders


class TargetGreedy:
    """Target-only greedy decoding at batch 1 on the core, reusable across prompts."""

    def __init__(self, model: nn.Module, *, max_prompt: int, max_new_tokens: int, stop_ids: set[int],
                 graphs: bool | None = None):
        self.dec = GreedyDecoder(model, rows=1, max_prompt=max_prompt, max_new_tokens=max_new_tokens,
                                 stop_ids=stop_ids, graphs=graphs, sync_every=8)

    def __call__(self, prompt: list[int], max_new_tokens: int | None = None) -> Generation:
        if max_new_tokens is not None and max_new_tokens != self.dec.max_new:
            raise ValueError(f"this decoder was built for {self.dec.max_new} new tokens, not {max_new_tokens}")
        t0 = time.perf_counter()
        out = self.dec.generate([prompt])[0]
        return Generation(out, time.perf_counter() - t0, passes=len(out))


class Speculative:
    """Greedy speculative decoding at batch 1, reusable across prompts of up to `max_prompt` tokens."""

    def __init__(self, model: nn.Module, drafter: Drafter, *, max_prompt: int, max_new_tokens: int,
                 stop_ids: set[int], graphs: bool | None = None):
        B = drafter.block_size
        self.model, self.drafter, self.B = model, drafter, B
        self.max_prompt, self.max_new, self.stops = max_prompt, max_new_tokens, set(stop_ids)
        slots = max_prompt + max_new_tokens + B + 1  # a verified block may reach B past the last token
        self.core = Core(model, 1, slots, graphs=graphs)
        dev = self.core.device
        self.draft = DraftCache(drafter, slots, dev)
        self.embed = model.get_input_embeddings()  # the module: Gemma's scales its rows
        self.lm_head = model.get_output_embeddings().weight  # [V, D]; the same tensor when tied
        self.layers = list(drafter.target_layer_ids)
        self.bonus = torch.zeros(1, dtype=torch.long, device=dev)
        self.start = torch.zeros(1, dtype=torch.long, device=dev)  # the bonus token's position
        self.off = torch.zeros(1, dtype=torch.long, device=dev)
        self.limit = torch.full((1,), B, dtype=torch.long, device=dev)  # tokens this cycle may commit
        self.result = torch.zeros(B + 1, dtype=torch.long, device=dev)  # committed tokens, then their count - 1
        self._ar = torch.arange(B, device=dev)
        with self.core.attending(), torch.inference_mode():
            self.core.allocate()
            self._cycle = self.core.graphed(self._run_cycle)  # warm-up writes only slots a prompt rewrites

    def _run_cycle(self) -> None:
        drafts = self.draft.propose(self.bonus, self.start, self.embed, self.lm_head)  # [B-1]
        block = torch.cat([self.bonus, drafts])[None]  # [1, B]
        logits, feats = self.core.step(block, self.start, self.off, layer_ids=self.layers)
        choice = logits[0].argmax(-1)  # [B]: the target's next token after each block position
        agree = (drafts == choice[:-1]).long().cumprod(0).sum()
        n = torch.minimum(agree, self.limit[0] - 1)  # drafts accepted
        # the whole block's feats are written; rejected slots are overwritten next cycle
        self.draft.extend(feats[0], self.start)
        nxt = choice.gather(0, n[None])  # [1]
        self.result[: self.B] = torch.where(self._ar < n, torch.cat([drafts, nxt]), nxt)
        self.result[self.B] = n
        self.start += n + 1
        self.bonus.copy_(nxt)

    @torch.inference_mode()
    def __call__(self, prompt: list[int], max_new_tokens: int | None = None) -> Generation:
        max_new = self.max_new if max_new_tokens is None else max_new_tokens
        if not 1 <= max_new <= self.max_new:
            raise ValueError(f"max_new_tokens {max_new} outside 1..{self.max_new} (what this decoder was built for)")
        if not 1 <= len(prompt) <= self.max_prompt:
            raise ValueError(f"a prompt of {len(prompt)} tokens; this decoder takes 1..{self.max_prompt}")
        t0 = time.perf_counter()
        dev = self.core.device
        with self.core.attending():
            ids = torch.tensor([prompt], device=dev)
            logits, feats = self.core.fresh(self.off, ids, self.off, layer_ids=self.layers)
            self.start.fill_(0)
            self.draft.extend(feats[0], self.start)  # the prompt's context K/V
            self.bonus.copy_(logits[0, -1].argmax(-1, keepdim=True))
            self.start.fill_(len(prompt))
            gen = Generation([int(self.bonus)], 0.0)
            while len(gen.tokens) < max_new and gen.tokens[-1] not in self.stops:
                size = min(self.B, max_new - len(gen.tokens))  # a cycle commits <= size tokens
                self.limit.fill_(size)
                self._cycle()
                res = self.result.tolist()  # the one synchronisation per cycle
                n = res[self.B]
                new = res[: n + 1]
                gen.accept_lengths.append(n + 1)
                gen.drafted += size - 1
                gen.accepted += n
                stop = next((i for i, t in enumerate(new) if t in self.stops), None)
                gen.tokens += new if stop is None else new[: stop + 1]
        gen.seconds = time.perf_counter() - t0
        return gen


@torch.inference_mode()
def greedy(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, stop_ids: set[int]) -> Generation:
    """Target-only greedy decoding of `prompt` [P] (a one-off TargetGreedy)."""
    ids = prompt.tolist()
    return TargetGreedy(model, max_prompt=len(ids), max_new_tokens=max_new_tokens, stop_ids=stop_ids)(ids)


@torch.inference_mode()
def speculative_greedy(model: nn.Module, drafter: Drafter, prompt: torch.Tensor, max_new_tokens: int,
                       stop_ids: set[int]) -> Generation:
    """Greedy decoding of `prompt` [P] with draft/verify cycles (a one-off Speculative)."""
    ids = prompt.tolist()
    return Speculative(model, drafter, max_prompt=len(ids), max_new_tokens=max_new_tokens, stop_ids=stop_ids)(ids)
