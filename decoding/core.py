"""The greedy decoding core shared by `--regenerate`, `dflash-eval` and the live evaluation:
a static (pre-allocated) KV cache, explicit attention masks, CUDA graphs on a GPU, and
continuous batching. It owns every call of a target's forward made while decoding; the
callers (producers/regenerate.py, consumers/speculative.py) only schedule.

Why its own cache: transformers' caches cannot be cropped once a sliding-window layer is
past its window (speculative decoding must drop rejected drafts), grow one token at a time
(no CUDA graph), and build masks on the host. Here every layer keeps all slots of a row
(sliding windows are applied by the mask, not by evicting), so a crop only moves a length,
and one decode step has fixed shapes and can be captured in a CUDA graph and replayed.

Layout: row b's slot s holds the token at position s - off[b] (left padding: slots before
off[b] are empty). A query at slot t sees slot s iff off[b] <= s <= t, s < end[b] and, on a
sliding layer, t - s < window (transformers' rule: the token itself and window-1 before).

Attention in a decode step (docs/REGENERATION.md "Decode attention"): on a GPU, torch's
flex attention over a block mask built from each row's own slot range, so a step reads only
the K/V blocks a row uses (the flex-decoding kernel: the K/V split over the GPU, query heads
that share a K/V head in one pass); on a CPU, or with `kernel="sdpa"`, sdpa over all slots
with an additive mask. Prefills always take the sdpa path (their masks are dense).

Imports torch, numpy, transformers and runtime/hf_compat.py only, so a GPU benchmark can load
it on a bare machine.
"""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch
from torch import nn

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch < 2.5: the sdpa path only
    BlockMask = flex_attention = None

from dflash.runtime.hf_compat import cache_kwarg

_FULL, _SLIDING = "full_attention", "sliding_attention"


# ---------------------------------------------------------------- what the model needs


def _text_config(model: nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def layer_windows(model: nn.Module) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention), as transformers applies it."""
    cfg = _text_config(model)
    n, window = cfg.num_hidden_layers, getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:  # Mistral, Phi-3: one window (or none) for every layer
        return [window] * n
    bad = sorted(set(types) - {_FULL, _SLIDING})
    if bad:
        raise ValueError(f"{cfg.model_type}: layer types {bad} are not supported by the decoding core "
                         f"(full and sliding-window attention are)")
    if _SLIDING in types and not window:
        raise ValueError(f"{cfg.model_type}: sliding-window layers but no config.sliding_window")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(f"{cfg.model_type}: bidirectional attention is not causal decoding")
    return [window if t == _SLIDING else None for t in types[:n]]


_DECODE = "decoding_core"  # no "flash" in it: transformers takes such names for hub kernels


def _decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The core's attention: flex attention when the core passes a BlockMask (decode steps on
    a GPU), else sdpa with the core's additive mask (`_sdpa_packed`)."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError(f"{_DECODE}: soft-capping and attention sinks are not supported (decoding uses eager)")
    if BlockMask is not None and isinstance(attention_mask, BlockMask):
        return _flex(query, key, value, attention_mask, scaling), None
    return _sdpa_packed(query, key, value, attention_mask, scaling), None


def _sdpa_packed(query, key, value, attention_mask, scaling):
    """sdpa for the core's masks without repeating K/V for every query head: transformers
    repeats them whenever a mask is given (a copy of the whole cache per layer and step,
    which dominated a decode step at batch 256). Query heads that share a K/V head (head h
    uses K/V head h // g, as repeat_kv lays them out) become extra query rows instead."""
    B, Hq, q, hd = query.shape
    Hkv = key.shape[1]
    g = Hq // Hkv
    if attention_mask is None:  # a plain forward of the model (not the core's): causal
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=q > 1, scale=scaling,
                                                               enable_gqa=g > 1)
        return out.transpose(1, 2).contiguous()
    qp = query.reshape(B, Hkv, g * q, hd)
    mask = attention_mask[:, :, :, : key.shape[2]]
    if g > 1:
        mask = mask[:, :, None].expand(B, mask.shape[1], g, q, mask.shape[-1]).reshape(B, mask.shape[1], g * q, -1)
    out = torch.nn.functional.scaled_dot_product_attention(qp, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(B, Hq, q, hd).transpose(1, 2).contiguous()


FLEX_COMPILE: bool | None = None  # None: compiled on CUDA, eager elsewhere (tests set True to run the CPU kernel)
_flex_compiled = None


def _flex(query, key, value, block_mask, scaling):
    """flex attention over the block mask: compiled (the Triton flex-decoding kernel on a GPU;
    uncompiled flex computes every score in full)."""
    global _flex_compiled
    fn = flex_attention
    if FLEX_COMPILE or (FLEX_COMPILE is None and query.is_cuda):
        if _flex_compiled is None:
            import torch._dynamo

            # Each cache shape (rows, slots, q) and window kind is one compiled graph; a producer
            # builds a few decoders over a run, and past the limit dynamo would fall back to
            # uncompiled flex, which is correct but computes every score.
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
            _flex_compiled = torch.compile(flex_attention, dynamic=False)
        fn = _flex_compiled
    B, Hq, q, hd = query.shape
    g = Hq // key.shape[1]
    if fold_heads(Hq, key.shape[1]):  # the query heads of a K/V head as more queries of it (Core._block_masks)
        out = fn(query.reshape(B, key.shape[1], g * q, hd), key, value, block_mask=block_mask, scale=scaling)
        return out.reshape(B, Hq, q, hd).transpose(1, 2).contiguous()
    out = fn(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=g > 1)
    return out.transpose(1, 2).contiguous()


def fold_heads(heads: int, kv_heads: int) -> bool:
    """Whether flex decoding takes a layer's query heads folded into the query length: the
    flex-decoding kernel serves grouped-query attention only for a power-of-two group (else
    inductor falls back to the prefill kernel, which pads each row's one query to a tile)."""
    g = heads // kv_heads
    return g > 1 and g & (g - 1) != 0


def _register() -> bool:
    try:
        from transformers import AttentionInterface

        AttentionInterface.register(_DECODE, _decode_attention)
        return True
    except (ImportError, AttributeError):  # older transformers: plain sdpa
        return False


_HAS_DECODE = _register()


def decode_attention(model: nn.Module) -> str:
    """The attention implementation decoding runs with: the core's own (`_decode_attention`:
    flex or sdpa without K/V repetition), or eager where the model needs what those lack
    (logit soft-capping, Gemma 2; attention sinks, GPT-OSS, whose class refuses sdpa). All
    take the core's masks."""
    cfg = _text_config(model)
    if getattr(cfg, "attn_logit_softcapping", None) or not getattr(type(model), "_supports_sdpa", True):
        return "eager"
    return _DECODE if _HAS_DECODE else "sdpa"


def step_kernel(model: nn.Module, device: torch.device, kernel: str = "auto") -> str:
    """The decode step's attention kernel: "flex" (block-sparse over each row's slots) or
    "sdpa" (all slots, masked). auto: flex on a GPU where the model runs the core's own
    attention, sdpa elsewhere (on a CPU uncompiled flex computes every score)."""
    if kernel not in ("auto", "flex", "sdpa"):
        raise ValueError(f"decode kernel {kernel!r}: expected auto, flex or sdpa")
    if kernel == "auto":
        kernel = "flex" if device.type == "cuda" else "sdpa"
    if kernel == "flex" and (BlockMask is None or decode_attention(model) != _DECODE):
        return "sdpa"  # eager-attention models and old torch: masks only
    return kernel


# ---------------------------------------------------------------- the cache


class StaticKV:
    """K/V of `rows` x `slots` per layer, allocated at the first write (shapes from the model's
    own key states). Stands in for transformers' Cache: attention layers call `update`.

    Two modes, set by `begin` before each forward: `fresh` (the rows start new sequences: the
    keys written are all there is, attention runs over them alone) and `step` (every row
    appends q tokens at slot start[b]; attention runs over all slots, masked)."""

    is_compileable = False  # transformers' generate() must not try to compile around it

    def __init__(self, rows: int, slots: int):
        self.rows, self.slots = rows, slots
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        self._rows: torch.Tensor | None = None  # fresh: which rows; step: all
        self._index: torch.Tensor | None = None  # step: [B, q] slots written; packed: [T]
        self._packed = False

    def begin_fresh(self, rows: torch.Tensor) -> None:
        self._rows, self._index, self._packed = rows, None, False

    def begin_step(self, index: torch.Tensor) -> None:
        self._rows, self._index, self._packed = None, index, False

    def begin_packed(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Packed prefill: token t of the one packed sequence goes to (rows[t], slots[t])."""
        self._rows, self._index = rows, slots
        self._packed = True

    def _alloc(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        while len(self.k) <= layer:
            self.k.append(None)
            self.v.append(None)
        if self.k[layer] is None:
            self.k[layer] = k.new_zeros(self.rows, k.shape[1], self.slots, k.shape[3])
            self.v[layer] = v.new_zeros(self.rows, v.shape[1], self.slots, v.shape[3])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value [R, H, q, hd] -> the keys/values attention runs over."""
        self._alloc(layer_idx, key_states, value_states)
        K, V = self.k[layer_idx], self.v[layer_idx]
        q = key_states.shape[2]
        if self._packed:  # [1, H, T, hd]: each token to its row and slot; attention over the pack
            K[self._rows, :, self._index] = key_states[0].transpose(0, 1)  # [T, H, hd]
            V[self._rows, :, self._index] = value_states[0].transpose(0, 1)
            return key_states, value_states
        if self._index is None:  # fresh rows: slots 0..q-1
            K[self._rows, :, :q] = key_states
            V[self._rows, :, :q] = value_states
            return key_states, value_states
        b = torch.arange(K.shape[0], device=K.device)[:, None]  # [B, 1]
        K[b, :, self._index] = key_states.transpose(1, 2)  # advanced dims first: [B, q, H, hd]
        V[b, :, self._index] = value_states.transpose(1, 2)
        return K, V

    # What transformers may ask of a cache; positions and masks are always passed explicitly.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __len__(self) -> int:
        return len(self.k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


def kv_bytes_per_slot(model: nn.Module, dtype: torch.dtype) -> int:
    """K+V bytes one slot of one row takes over all layers (for sizing the cache)."""
    cfg = _text_config(model)
    heads = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return cfg.num_hidden_layers * 2 * kv * hd * torch.empty(0, dtype=dtype).element_size()


def rows_for_memory(model: nn.Module, dtype: torch.dtype, budget_bytes: int, slots: int, cap: int) -> int:
    """How many rows of `slots` slots a KV cache of `budget_bytes` holds, 1..cap."""
    per_row = kv_bytes_per_slot(model, dtype) * max(1, slots)
    return max(1, min(cap, budget_bytes // per_row))


def graphed_prefill_default(model: nn.Module, device: torch.device) -> bool:
    """Whether prefills run as PackedPrefill's graphed packs by default: on a GPU, for targets
    small enough that an eager prefill's time is mostly the host running transformers'
    per-layer Python (a graph removes it); a large target's prefill is GPU time, which the
    packs' padding only adds to (docs/REGENERATION.md "Batched prefills")."""
    if device.type != "cuda":
        return False
    return sum(p.numel() for p in model.parameters()) <= GRAPHED_PREFILL_MAX_PARAMS


GRAPHED_PREFILL_MAX_PARAMS = 2_000_000_000


# ---------------------------------------------------------------- the forward


class Core:
    """A target's forward over a StaticKV, with the core's masks; graphs on CUDA.

    `rows` x `slots` is the cache; `layer_ids` (optional) are the layers whose outputs
    (hidden_states[i + 1]) a forward also returns, concatenated, for a DFlash drafter."""

    def __init__(self, model: nn.Module, rows: int, slots: int, *, graphs: bool | None = None, kernel: str = "auto",
                 kv_block: int = 128):
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.rows, self.slots = rows, slots
        self.cache = StaticKV(rows, slots)
        self.windows = layer_windows(model)
        self.kinds = sorted({w for w in self.windows}, key=lambda w: (w is not None, w or 0))
        if len([w for w in self.kinds if w is not None]) > 1:
            raise ValueError(f"layers with different sliding windows {self.kinds} are not supported")
        self.attn = decode_attention(model)
        self.kernel = step_kernel(model, self.device, kernel)
        self.kv_block = kv_block  # flex: K/V blocks a step reads whole (a multiple of its kernel's tile)
        cfg = _text_config(model)
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self._blocks = -(-slots // kv_block)
        self._block_ar = torch.arange(self._blocks, device=self.device, dtype=torch.int32)
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self._kw = cache_kwarg(model)
        self._neg = torch.finfo(self.dtype).min
        self._slot_ar = torch.arange(slots, device=self.device)
        self._pool = None
        self.captured = 0  # graphs captured (figures for benchmarks)
        self.graph_error: str | None = None  # why the last capture failed, if it did
        self.kernel_error: str | None = None  # why flex was given up for sdpa, if it was
        self._flex_tried = False  # the first graphed function runs once uncaptured to try flex (_try_flex)

    # ------------------------------------------------------------ masks

    def _masks(self, qslot: torch.Tensor, off: torch.Tensor, end: torch.Tensor, kv: int):
        """Additive masks [R, 1, q, kv] (0 visible, dtype min hidden) for qslot [R, q] (the
        query's slot), off/end [R]: one tensor, or a dict by layer type where they differ."""
        s = self._slot_ar[:kv]
        base = (s[None, None] >= off[:, None, None]) & (s[None, None] < end[:, None, None]) \
            & (s[None, None] <= qslot[:, :, None])  # [R, q, kv]
        out = {}
        for w in self.kinds:
            vis = base if w is None else base & (qslot[:, :, None] - s[None, None] < w)
            out[_FULL if w is None else _SLIDING] = torch.where(vis, 0.0, self._neg).to(self.dtype)[:, None]
        if len(out) == 1:
            return next(iter(out.values()))
        return out

    def _block_masks(self, qslot: torch.Tensor, off: torch.Tensor):
        """flex's masks for a step, qslot [R, q] (slots of the queries, consecutive), off [R]:
        a query at slot t sees off[b] <= s <= t (and t - s < window on a sliding layer), as
        `_masks`; the blocks listed for row b are those from its first visible slot to its
        last query's slot, so the kernel reads no block of the row's padding or empty slots.
        Tensors only (no host sync): capturable in the step's CUDA graph."""
        R, q = qslot.shape
        g = self.heads // self.kv_heads if fold_heads(self.heads, self.kv_heads) else 1  # flex's query length: g * q
        out = {}
        for w in self.kinds:
            lo = off if w is None else torch.maximum(off, qslot[:, 0] - (w - 1))
            first = torch.div(lo, self.kv_block, rounding_mode="floor").to(torch.int32)
            last = torch.div(qslot[:, -1], self.kv_block, rounding_mode="floor").to(torch.int32)
            count = (last - first + 1).clamp_min(1)[:, None, None]  # [R, 1, 1]
            index = (first[:, None] + self._block_ar[None]).clamp_max(self._blocks - 1)[:, None, None]  # [R,1,1,n]
            out[_FULL if w is None else _SLIDING] = _block_mask(count, index, (128, self.kv_block),
                                                                 _visible(qslot, off, w, q), (g * q, self.slots))
        return next(iter(out.values())) if len(out) == 1 else out

    # ------------------------------------------------------------ forwards

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, mask, layer_ids: list[int] | None, logits_to_keep: int):
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                         output_hidden_states=layer_ids is not None, logits_to_keep=logits_to_keep,
                         **{self._kw: self.cache})
        feats = None
        if layer_ids is not None:
            feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)  # [R, q, n*D]
        return out.logits, feats

    def fresh(self, rows: torch.Tensor, ids: torch.Tensor, off: torch.Tensor, *, layer_ids: list[int] | None = None,
              last_only: bool = True):
        """Start new sequences in `rows` [R]: ids [R, W] left padded (off[r] pad slots first).
        Returns (logits [R, 1 or W, V], features [R, W, n*D] or None). Not graphed (shapes vary)."""
        R, W = ids.shape
        if W > self.slots:
            raise ValueError(f"a prompt of {W} tokens does not fit the cache's {self.slots} slots")
        qslot = torch.arange(W, device=self.device)[None].expand(R, W)
        mask = self._masks(qslot, off, torch.full_like(off, W), W)
        self.cache.begin_fresh(rows)
        return self._run(ids, (qslot - off[:, None]).clamp_min(0), mask, layer_ids, 1 if last_only else 0)

    def fresh_packed(self, rows: torch.Tensor, prompts: list[list[int]]) -> torch.Tensor:
        """Start new sequences in `rows` [R] from `prompts` in one forward of them packed back
        to back (no padding: a block-diagonal causal mask keeps them apart), each written to
        slots 0..len-1 of its row. Returns the logits at each prompt's last token [R, V]."""
        lens = [len(p) for p in prompts]
        if max(lens) > self.slots:
            raise ValueError(f"a prompt of {max(lens)} tokens does not fit the cache's {self.slots} slots")
        dev = self.device
        n = torch.tensor(lens, device=dev)
        seg = torch.repeat_interleave(torch.arange(len(lens), device=dev), n)  # [T] which prompt
        pos = torch.arange(int(n.sum()), device=dev) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        ids = torch.tensor([t for p in prompts for t in p], device=dev)
        return self.packed(ids, seg, pos, rows[seg], pos, torch.cumsum(n, 0) - 1)

    def packed(self, ids: torch.Tensor, seg: torch.Tensor, pos: torch.Tensor, row: torch.Tensor, slot: torch.Tensor,
               last: torch.Tensor) -> torch.Tensor:
        """One forward of packed tokens ids [T]: token t is at position pos[t] of segment seg[t]
        (it sees the earlier tokens of its own segment only) and its K/V go to cache row
        row[t], slot slot[t]. Returns the logits at the tokens `last` [R] -> [R, V]. Tensors
        in, tensors out: capturable in a CUDA graph for fixed T and R."""
        vis = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])  # [T, T]
        masks = {}
        for w in self.kinds:
            v = vis if w is None else vis & (pos[:, None] - pos[None, :] < w)
            masks[_FULL if w is None else _SLIDING] = torch.where(v, 0.0, self._neg).to(self.dtype)[None, None]
        mask = next(iter(masks.values())) if len(masks) == 1 else masks
        self.cache.begin_packed(row, slot)
        logits, _ = self._run(ids[None], pos[None], mask, None, last)
        return logits[0]

    def step(self, ids: torch.Tensor, start: torch.Tensor, off: torch.Tensor, *,
             layer_ids: list[int] | None = None, last_only: bool = False):
        """Every row appends ids [B, q] at slots start[b]..start[b]+q-1 (B = all rows).
        Returns (logits [B, q or 1, V], features or None). Fixed shapes: graph-capturable."""
        q = ids.shape[1]
        qslot = (start[:, None] + torch.arange(q, device=self.device)[None]).clamp_max(self.slots - 1)
        # flex only where the model runs the core's attention (a transformers that refused its
        # name runs plain sdpa, which takes tensor masks)
        if self.kernel == "flex" and getattr(self.model.config, "_attn_implementation", None) == _DECODE:
            mask = self._block_masks(qslot, off)
        else:
            mask = self._masks(qslot, off, qslot[:, -1] + 1, self.slots)
        self.cache.begin_step(qslot)
        return self._run(ids, qslot - off[:, None], mask, layer_ids, 1 if last_only else 0)

    def attending(self) -> "_attention":
        """Context in which the model runs with the core's attention implementation (every
        forward of the core must run inside it; the model's own setting is restored after)."""
        return _attention(self.model, self.attn)

    # ------------------------------------------------------------ graphs

    def graphed(self, fn: Callable[[], None]) -> Callable[[], None]:
        """`fn` (reads and writes only tensors that live as long as it) as a replayable CUDA
        graph; `fn` itself on CPU or with graphs off. Capturing runs `fn` for warm-up, so
        call this before the tensors hold real state."""
        if self.kernel == "flex" and not self._flex_tried:
            self._try_flex(fn)
        if not self.graphs:
            return fn
        try:
            return self._capture(fn)
        except RuntimeError as e:  # a model whose forward cannot be captured still decodes
            warnings.warn(f"CUDA graph capture failed, decoding without graphs: {type(e).__name__}: {e}")
            self.graph_error = f"{type(e).__name__}: {e}"[:500]
            torch.cuda.synchronize(self.device)
            return fn

    def _try_flex(self, fn: Callable[[], None]) -> None:
        """Run `fn` (the first function graphed: a decode step or cycle) once; its first flex
        call compiles the kernel. If flex fails to compile or run here, decode with sdpa
        instead, warned and recorded, rather than not at all."""
        self._flex_tried = True
        try:
            fn()
        except Exception as e:  # noqa: BLE001  (inductor and Triton raise many kinds)
            self.kernel, self.kernel_error = "sdpa", f"{type(e).__name__}: {e}"[:500]
            warnings.warn(f"flex decode attention failed, decoding with sdpa: {self.kernel_error}")
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def _capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lazy inits and allocator state outside the capture
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            fn()
        self.captured += 1
        return g.replay

    def allocate(self) -> None:
        """Allocate every layer's K/V now (one throwaway token in row 0), so that graphs
        captured next see the final buffers."""
        if len(self.cache) == 0:
            z = torch.zeros(1, dtype=torch.long, device=self.device)
            self.fresh(z, z[:, None], z)


def _block_mask(count, index, block_size, mask_mod, seq_lengths):
    try:  # no transposed (backward) block lists: decoding never runs a backward
        return BlockMask.from_kv_blocks(count, index, BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                        seq_lengths=seq_lengths, compute_q_blocks=False)
    except TypeError:  # a torch without the flag
        return BlockMask.from_kv_blocks(count, index, BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                        seq_lengths=seq_lengths)


def _visible(qslot: torch.Tensor, off: torch.Tensor, window: int | None, q: int):
    """flex's mask_mod for `Core._block_masks`: the element-level rule inside listed blocks
    (query index i is query i % q of its row: folded heads repeat the row's q queries)."""

    def mask_mod(b, h, q_idx, kv_idx):
        t = qslot[b, q_idx % q]
        vis = (kv_idx >= off[b]) & (kv_idx <= t)
        return vis if window is None else vis & (t - kv_idx < window)

    return mask_mod


class _attention:
    """Run the model with attention implementation `name` for the duration (restored after)."""

    def __init__(self, model: nn.Module, name: str):
        self.model, self.name = model, name

    def __enter__(self):
        cfg = self.model.config
        self.before = getattr(cfg, "_attn_implementation", None)
        if self.before != self.name:
            try:
                self.model.set_attn_implementation(self.name)
            except (ValueError, KeyError) as e:  # a transformers that refuses registered names
                if self.name != _DECODE:
                    raise
                warnings.warn(f"attention {_DECODE} refused ({e}); decoding with sdpa")
                self.name = "sdpa"
                if self.before != self.name:
                    self.model.set_attn_implementation(self.name)

    def __exit__(self, *exc):
        if self.before != self.name and self.before is not None:
            self.model.set_attn_implementation(self.before)


# ---------------------------------------------------------------- greedy decoding


def pack_sizes(limit: int) -> list[int]:
    """The fixed sizes packed prefills are padded to, up to `limit` tokens: 64, 128, 256, 512,
    then steps of 512, so padding wastes at most half of a small pack and an eighth of a
    large one (for a large target a pack's compute is GPU time, not host time)."""
    sizes = [x for x in (64, 128, 256, 512) if x < limit] + list(range(512, limit, 512)) + [limit]
    return sorted(set(sizes))


class PackedPrefill:
    """Prefill of refilled rows, their prompts packed back to back into one forward
    (Core.packed), padded to the smallest of `sizes` that holds them, and from a size's
    second use on replayed from a CUDA graph of that size: a decoder refills many times,
    and each eager forward pays transformers' per-layer Python again (whether that is most
    of a prefill's time, `bench/decode_speed.py --sections where` measures). Pad tokens
    are a segment of their own, written to the cache's last slot, which no live row ever
    attends (GreedyDecoder sizes the cache one slot longer than any row can reach).
    Returns the first token of each prompt, `pick`ed from its last position's logits."""

    def __init__(self, core: Core, rows: int, sizes: Iterable[int], pick: Callable[[torch.Tensor], torch.Tensor]):
        self.core, self.rows, self.pick = core, rows, pick
        self.sizes = sorted(set(sizes))
        self._used: set[int] = set()
        self._static: dict[int, tuple[torch.Tensor, torch.Tensor, Callable[[], None]]] = {}
        self._first = torch.zeros(rows, dtype=torch.long, device=core.device)  # every graph's output
        self.replays = 0  # forwards run from a graph, or from its fallback (figures for benchmarks)

    @property
    def limit(self) -> int:
        return self.sizes[-1]

    def __call__(self, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        lens = [len(p) for p in prompts]
        T, R = sum(lens), len(prompts)
        if T > self.limit or R > self.rows:
            raise ValueError(f"a pack of {T} tokens in {R} rows exceeds {self.limit} tokens or {self.rows} rows")
        size = next(x for x in self.sizes if x >= T)
        seg = np.repeat(np.arange(R), lens)
        pos = np.arange(T) - np.repeat(np.cumsum(lens) - lens, lens)
        host = np.zeros((5, size), dtype=np.int64)  # ids, segment, position, cache row, cache slot
        host[0, :T] = [t for p in prompts for t in p]
        host[1, :T], host[1, T:] = seg, R  # pads: a segment of their own
        host[2, :T] = pos
        host[3, :T] = np.asarray(rows)[seg]
        host[4, :T], host[4, T:] = pos, self.core.slots - 1
        last = np.zeros(self.rows, dtype=np.int64)
        last[:R] = np.cumsum(lens) - 1
        if size not in self._static:
            packed = torch.from_numpy(host).to(self.core.device)
            where = torch.from_numpy(last).to(self.core.device)
            if size not in self._used:  # a size used once (one eval prompt) is not worth a capture
                self._used.add(size)
                return self.pick(self.core.packed(*packed, where))[:R]
            # The capture's warm-up runs the prefill twice on these inputs: the same writes each time.
            replay = self.core.graphed(lambda: self._first.copy_(self.pick(self.core.packed(*packed, where))))
            self._static[size] = (packed, where, replay)
        else:
            packed, where, replay = self._static[size]
            packed.copy_(torch.from_numpy(host))
            where.copy_(torch.from_numpy(last))
        replay()
        self.replays += 1
        return self._first[:R].clone()


@dataclass
class Job:
    key: object
    prompt: list[int]
    max_new: int | None = None  # fewer new tokens than the decoder's max_new_tokens, if set


class GreedyDecoder:
    """Batched greedy decoding with continuous batching: `rows` slots; a finished row's slot
    is refilled with the next prompt at once. One decode step of all rows is a CUDA graph on
    a GPU; the host looks at which rows finished every `sync_every` steps (its only
    synchronisation), and refills when at least `refill_min` rows are free or nothing else runs.

    Each output is the greedy continuation up to and including the first stop token, or
    `max_new_tokens` tokens: exactly what `generate(do_sample=False)` gives. `pick` (logits
    [rows, vocab] -> token IDs [rows]) replaces the argmax, e.g. with a `Sampler`."""

    def __init__(self, model: nn.Module, *, rows: int, max_prompt: int, max_new_tokens: int, stop_ids: Iterable[int],
                 graphs: bool | None = None, sync_every: int = 8, refill_min: int | None = None,
                 prefill_tokens: int = 2048, prefill_sizes: Iterable[int] | None = None,
                 pick: Callable[[torch.Tensor], torch.Tensor] | None = None, kernel: str = "auto",
                 kv_block: int = 128):
        if rows < 1 or max_new_tokens < 1:
            raise ValueError(f"rows {rows} and max_new_tokens {max_new_tokens} must be >= 1")
        self.max_prompt, self.max_new = max_prompt, max_new_tokens
        # A live row writes at most slot max_prompt + max_new_tokens - 2: the slots after it
        # are never attended, and PackedPrefill's pad tokens write to the last.
        self.core = Core(model, rows, max_prompt + max_new_tokens + 1, graphs=graphs, kernel=kernel, kv_block=kv_block)
        self.rows, self.sync_every = rows, max(1, sync_every)
        self.refill_min = max(1, rows // 16) if refill_min is None else max(1, refill_min)
        dev = self.core.device
        stops = sorted(set(stop_ids))
        self.stops = torch.tensor(stops or [-1], device=dev)
        self.tok = torch.zeros(rows, dtype=torch.long, device=dev)  # each row's last token
        self.start = torch.zeros(rows, dtype=torch.long, device=dev)  # slot its next token goes to
        self.off = torch.zeros(rows, dtype=torch.long, device=dev)
        self.n = torch.zeros(rows, dtype=torch.long, device=dev)  # tokens generated
        self.done = torch.ones(rows, dtype=torch.bool, device=dev)
        self.limit = torch.full((rows,), max_new_tokens, dtype=torch.long, device=dev)  # per row
        self.out = torch.zeros(rows, max_new_tokens, dtype=torch.long, device=dev)
        self._ar = torch.arange(rows, device=dev)
        self.steps = 0  # decode steps run (figures for benchmarks)
        self.prefills = 0  # prefill forwards run
        self.packed_prefills = 0  # of which packed (Core.fresh_packed, PackedPrefill)
        self.pick = pick or _argmax
        # `prefill_sizes` (e.g. pack_sizes(4096)): prompts packed into those sizes, graphed on a
        # GPU (PackedPrefill); else exact shapes, packed or left padded by their cost (_fill).
        # Off by default until a GPU measurement says it is faster (docs/REGENERATION.md).
        self.prefill = PackedPrefill(self.core, rows, prefill_sizes, self.pick) if prefill_sizes else None
        self.prefill_tokens = max(1, prefill_tokens)
        with self.core.attending(), torch.inference_mode():
            self.core.allocate()
            self._step = self.core.graphed(self._decode_step)  # all rows done: warm-up changes nothing real

    @torch.inference_mode()
    def _decode_step(self) -> None:
        logits, _ = self.core.step(self.tok[:, None], self.start, self.off, last_only=True)
        nxt = self.pick(logits[:, -1])
        live = ~self.done
        col = self.n.clamp_max(self.max_new - 1)
        self.out[self._ar, col] = torch.where(live, nxt, self.out[self._ar, col])
        self.n += live
        self.start += live
        self.tok.copy_(torch.where(live, nxt, self.tok))
        self.done |= live & (torch.isin(nxt, self.stops) | (self.n >= self.limit))

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        """Greedy continuations of `prompts`, in order."""
        res: list[list[int] | None] = [None] * len(prompts)

        def keep(job: Job, tokens: list[int]) -> None:
            res[job.key] = tokens

        left = self.run(deque(Job(i, p) for i, p in enumerate(prompts)), keep)
        if left:
            raise ValueError(f"{len(left)} prompt(s) exceed the decoder's max_prompt {self.max_prompt}")
        return res  # type: ignore[return-value]

    @torch.inference_mode()
    def run(self, jobs: deque, on_done: Callable[[Job, list[int]], None]) -> list[Job]:
        """Decode every job of `jobs` (a deque `on_done` may append new jobs to, e.g. a
        conversation's next turn) and hand each result to `on_done` as it finishes.
        Returns the jobs whose prompt is longer than `max_prompt` (not decoded: the caller
        sizes a decoder for them). Raises ValueError for an empty prompt."""
        leftover: list[Job] = []
        with self.core.attending():
            for _ in self.rounds(jobs, on_done, leftover):
                pass
        return leftover

    def rounds(self, jobs: deque, on_done: Callable[[Job, list[int]], None], leftover: list[Job]):
        """`run` one round at a time: a generator that refills free rows and runs
        `sync_every` steps per `next()`, until `jobs` and the rows are empty. Between
        rounds the caller may add jobs to `jobs` (other threads too: deque appends are
        atomic) and release the model; every `next()` must run inside `core.attending()`
        and `torch.inference_mode()`. Too-long prompts go to `leftover`."""
        busy: dict[int, Job] = {}
        free = list(range(self.rows))
        while jobs or busy:
            if jobs and free and (len(free) >= self.refill_min or not busy or len(jobs) <= len(free)):
                take = []
                while jobs and len(take) < len(free):
                    j = jobs.popleft()
                    if not j.prompt:
                        raise ValueError(f"job {j.key!r}: empty prompt")
                    if len(j.prompt) > self.max_prompt:
                        leftover.append(j)
                    else:
                        take.append(j)
                take = [(free.pop(0), j) for j in take]
                if take:
                    self._fill(take)
                    busy.update(take)
            if not busy:
                continue
            for _ in range(self.sync_every):
                self._step()
            self.steps += self.sync_every
            done = self.done.tolist()  # the one synchronisation per `sync_every` steps
            finished = [r for r in busy if done[r]]
            if finished:
                idx = torch.tensor(finished, device=self.core.device)
                lens = self.n[idx].tolist()
                outs = self.out[idx].tolist()
                for r, n, o in zip(finished, lens, outs):
                    job = busy.pop(r)
                    free.append(r)
                    on_done(job, o[:n])
            yield len(busy)

    @property
    def busy_rows(self) -> int:
        """Rows decoding now (between rounds)."""
        return int((~self.done).sum())

    def _fill(self, take: list[tuple[int, Job]]) -> None:
        """Prefill the prompts of `take` into their rows and set the rows' state, in as few
        forwards as fit, sorted by length (similar widths share a forward). With
        `self.prefill`: packs of up to its limit, a longer prompt alone. Else parts of up to 64
        rows, each packed back to back (no padding, at most `prefill_tokens` tokens) where
        that computes fewer attention scores than left padding to its longest prompt (T^2 <
        R * W^2: lengths that differ a lot), else left padded (with a dense mask, packed
        attention is quadratic in the total length)."""
        take = sorted(take, key=lambda t: len(t[1].prompt))
        if self.prefill is not None:
            pack: list[tuple[int, Job]] = []
            tokens = 0
            for r, j in take:
                if len(j.prompt) > self.prefill.limit:
                    self._prefill([(r, j)], packed=False)
                    continue
                if pack and tokens + len(j.prompt) > self.prefill.limit:
                    self._prefill_pack(pack)
                    pack, tokens = [], 0
                pack.append((r, j))
                tokens += len(j.prompt)
            if pack:
                self._prefill_pack(pack)
            return
        for i in range(0, len(take), 64):
            part = take[i:i + 64]
            lens = [len(j.prompt) for _, j in part]
            t = sum(lens)
            self._prefill(part, packed=t * t < len(lens) * max(lens) ** 2 and t <= self.prefill_tokens)

    def _prefill_pack(self, part: list[tuple[int, Job]]) -> None:
        dev = self.core.device
        first = self.prefill([r for r, _ in part], [j.prompt for _, j in part])
        lens = torch.tensor([len(j.prompt) for _, j in part], device=dev)
        self._begin(part, torch.tensor([r for r, _ in part], device=dev), first, lens, torch.zeros_like(lens))
        self.packed_prefills += 1

    def _prefill(self, part: list[tuple[int, Job]], packed: bool) -> None:
        dev = self.core.device
        rows = torch.tensor([r for r, _ in part], device=dev)
        lens = torch.tensor([len(j.prompt) for _, j in part], device=dev)
        if packed:
            first = self.pick(self.core.fresh_packed(rows, [j.prompt for _, j in part]))
            off = torch.zeros_like(lens)
        else:
            W = int(lens.max())
            ids = torch.tensor([[0] * (W - len(j.prompt)) + j.prompt for _, j in part], device=dev)
            off = W - lens
            logits, _ = self.core.fresh(rows, ids, off)
            first = self.pick(logits[:, -1])
            lens = torch.full_like(lens, W)
        self._begin(part, rows, first, lens, off)
        self.packed_prefills += packed

    def _begin(self, part: list[tuple[int, Job]], rows: torch.Tensor, first: torch.Tensor, start: torch.Tensor,
               off: torch.Tensor) -> None:
        """The state of `part`'s rows (`rows`, on the device) just prefilled: `first` token of
        each, its next slot `start`, its padding `off`."""
        lim = torch.tensor([min(j.max_new or self.max_new, self.max_new) for _, j in part], device=self.core.device)
        self.prefills += 1
        self.tok[rows] = first
        self.start[rows] = start
        self.off[rows] = off
        self.n[rows] = 1
        self.out[rows, 0] = first
        self.limit[rows] = lim
        self.done[rows] = torch.isin(first, self.stops) | (lim <= 1)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


class Sampler:
    """Draws from softmax(logits / temperature), restricted to the `top_k` most likely
    tokens when top_k > 0, by the Gumbel-max trick: argmax(logits / T + G), G ~ Gumbel(0, 1).
    Elementwise ops and an argmax only, so it runs inside the decode step's CUDA graph
    (the default generator's offset advances on every replay); seed it with torch.manual_seed."""

    def __init__(self, temperature: float = 1.0, top_k: int = 0):
        if not temperature > 0 or top_k < 0:
            raise ValueError(f"temperature {temperature} must be > 0 and top_k {top_k} >= 0")
        self.temperature, self.top_k = temperature, top_k

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits.float() / self.temperature
        if self.top_k and self.top_k < x.shape[-1]:
            kth = x.topk(self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        u = torch.rand(x.shape, device=x.device).clamp_(min=torch.finfo(torch.float32).tiny)
        return (x - torch.log(-torch.log(u))).argmax(-1)


def greedy_generate(model: nn.Module, prompts: list[list[int]], *, max_new_tokens: int, stop_ids: Iterable[int],
                    batch_size: int = 16, graphs: bool | None = None, sync_every: int = 8) -> list[list[int]]:
    """Each prompt's greedy continuation (see GreedyDecoder), `batch_size` rows at a time."""
    if not prompts:
        return []
    dec = GreedyDecoder(model, rows=min(batch_size, len(prompts)), max_prompt=max(len(p) for p in prompts),
                        max_new_tokens=max_new_tokens, stop_ids=stop_ids, graphs=graphs, sync_every=sync_every)
    return dec.generate(prompts)


# ---------------------------------------------------------------- the tie rule


TIE_TOLERANCE = {torch.float32: 0.0, torch.float64: 0.0, torch.bfloat16: 0.5, torch.float16: 0.0625}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ (a shorter one differs at its end); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.inference_mode()
def divergence(model: nn.Module, prompt: list[int], a: list[int], b: list[int]) -> dict | None:
    """Where two greedy outputs of `prompt` first differ and how close the target was to a tie
    there, from one plain forward over the common prefix (transformers' own path):
    top2_margin = top-1 minus top-2 logit; flip_margin = top-1 minus the lower of the two
    tokens chosen (equal to top2_margin when they are the top two). None if a == b; a
    difference in length alone (one stopped) is reported with margins None."""
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
    """A difference that greedy decoding cannot be blamed for: both tokens within `tolerance`
    of the target's best logit at the first difference."""
    return div is not None and div["flip_margin"] is not None and div["flip_margin"] <= tolerance
