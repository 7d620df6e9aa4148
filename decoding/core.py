"""The greedy decoding core shared by `--regenerate`, `dflash-eval` and the live evaluation:
a static (pre-allocated) KV cache, explicit attention masks, CUDA graphs on a GPU. It owns
every target forward made while decoding; the callers only schedule.

Its own cache because transformers' cannot be cropped past a sliding window, grows a token at a
time (no CUDA graph) and builds masks on the host. Row b's slot s holds position s - off[b]; a
query at slot t sees s iff off[b] <= s <= t, s < end[b] (and t - s < window on a sliding layer)."""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import nn

from dflash.runtime.hf_compat import cache_kwarg

from .attention import (DECODE, FULL, SLIDING, attending, block_mask, decode_attention, fold_heads, layer_windows,
                        step_kernel, text_config, visible)
from .cache import CacheStandIn
from .paged import PagedKV, paged_block_masks


# ---------------------------------------------------------------- the cache


class StaticKV(CacheStandIn):
    """K/V of `rows` x `slots` per layer, allocated at the first write; `begin_*` sets the mode
    (fresh: attention over the new keys alone; step: over all slots, masked)."""

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


def kv_bytes_per_slot(model: nn.Module, dtype: torch.dtype) -> int:
    """K+V bytes one slot of one row takes over all layers (for sizing the cache)."""
    cfg = text_config(model)
    heads = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return cfg.num_hidden_layers * 2 * kv * hd * torch.empty(0, dtype=dtype).element_size()


def graphed_prefill_default(model: nn.Module, device: torch.device) -> bool:
    """Graphed packed prefills on a GPU for small targets only, whose eager prefill is mostly host
    Python; a large target's is GPU time the packs' padding adds to (docs/REGENERATION.md)."""
    if device.type != "cuda":
        return False
    return sum(p.numel() for p in model.parameters()) <= GRAPHED_PREFILL_MAX_PARAMS


GRAPHED_PREFILL_MAX_PARAMS = 2_000_000_000


# ---------------------------------------------------------------- the forward


class Core:
    """A target's forward over a StaticKV (or, `pages` > 0, a PagedKV whose table the caller
    fills), with the core's masks; graphs on CUDA."""

    def __init__(self, model: nn.Module, rows: int, slots: int, *, graphs: bool | None = None, kernel: str = "auto",
                 kv_block: int = 128, pages: int = 0):
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.paged = pages > 0
        if self.paged:
            slots = -(-slots // kv_block) * kv_block
            self.cache: StaticKV | PagedKV = PagedKV(rows, slots // kv_block, kv_block, pages, self.device)
        else:
            self.cache = StaticKV(rows, slots)
        self.rows, self.slots = rows, slots
        self.windows = layer_windows(model)
        self.kinds = sorted({w for w in self.windows}, key=lambda w: (w is not None, w or 0))
        if len([w for w in self.kinds if w is not None]) > 1:
            raise ValueError(f"layers with different sliding windows {self.kinds} are not supported")
        self.attn = decode_attention(model)
        self.kernel = step_kernel(model, self.device, kernel)
        self.kv_block = kv_block  # flex: K/V blocks a step reads whole (a multiple of its kernel's tile)
        cfg = text_config(model)
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
        self.captured = 0
        self.graph_error: str | None = None  # why the last capture failed, if it did
        self.kernel_error: str | None = None  # why flex was given up for sdpa, if it was
        self._flex_tried = False  # the first graphed function runs once uncaptured to try flex (_try_flex)

    # ------------------------------------------------------------ masks

    def _masks(self, qslot: torch.Tensor, off: torch.Tensor, end: torch.Tensor, kv: int):
        """Additive masks [R, 1, q, kv] for query slots qslot [R, q]: one, or a dict by layer type."""
        s = self._slot_ar[:kv]
        base = (s[None, None] >= off[:, None, None]) & (s[None, None] < end[:, None, None]) \
            & (s[None, None] <= qslot[:, :, None])  # [R, q, kv]
        out = {}
        for w in self.kinds:
            vis = base if w is None else base & (qslot[:, :, None] - s[None, None] < w)
            out[FULL if w is None else SLIDING] = torch.where(vis, 0.0, self._neg).to(self.dtype)[:, None]
        if len(out) == 1:
            return next(iter(out.values()))
        return out

    def _block_masks(self, qslot: torch.Tensor, off: torch.Tensor):
        """flex's masks for a step: row b lists only blocks from its first visible slot to its last
        query's, so no padding is read. No host sync: capturable in the step's graph."""
        R, q = qslot.shape
        g = self.heads // self.kv_heads if fold_heads(self.heads, self.kv_heads) else 1  # flex's query length: g * q
        if self.paged:
            out = paged_block_masks(self, self.cache, qslot, off, g, block_mask, self.kinds)
            out = {FULL if w is None else SLIDING: m for w, m in out.items()}
            return next(iter(out.values())) if len(out) == 1 else out
        out = {}
        for w in self.kinds:
            lo = off if w is None else torch.maximum(off, qslot[:, 0] - (w - 1))
            first = torch.div(lo, self.kv_block, rounding_mode="floor").to(torch.int32)
            last = torch.div(qslot[:, -1], self.kv_block, rounding_mode="floor").to(torch.int32)
            count = (last - first + 1).clamp_min(1)[:, None, None]  # [R, 1, 1]
            index = (first[:, None] + self._block_ar[None]).clamp_max(self._blocks - 1)[:, None, None]  # [R,1,1,n]
            out[FULL if w is None else SLIDING] = block_mask(count, index, (128, self.kv_block),
                                                                 visible(qslot, off, w, q), (g * q, self.slots))
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
        """Start sequences in `rows` from left-padded ids [R, W]; (logits, features or None). Not graphed."""
        R, W = ids.shape
        if W > self.slots:
            raise ValueError(f"a prompt of {W} tokens does not fit the cache's {self.slots} slots")
        qslot = torch.arange(W, device=self.device)[None].expand(R, W)
        mask = self._masks(qslot, off, torch.full_like(off, W), W)
        if self.paged:
            self.cache.begin_fresh(rows, off, W)
        else:
            self.cache.begin_fresh(rows)
        return self._run(ids, (qslot - off[:, None]).clamp_min(0), mask, layer_ids, 1 if last_only else 0)

    def fresh_packed(self, rows: torch.Tensor, prompts: list[list[int]]) -> torch.Tensor:
        """Start sequences in `rows` from `prompts` packed back to back in one forward (no padding);
        the logits at each prompt's last token [R, V]."""
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
        """One forward of packed tokens (each sees its own segment only; K/V to row[t], slot[t]);
        logits at `last`. Tensors only: capturable for fixed T and R."""
        vis = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])  # [T, T]
        masks = {}
        for w in self.kinds:
            v = vis if w is None else vis & (pos[:, None] - pos[None, :] < w)
            masks[FULL if w is None else SLIDING] = torch.where(v, 0.0, self._neg).to(self.dtype)[None, None]
        mask = next(iter(masks.values())) if len(masks) == 1 else masks
        self.cache.begin_packed(row, slot)
        logits, _ = self._run(ids[None], pos[None], mask, None, last)
        return logits[0]

    def step(self, ids: torch.Tensor, start: torch.Tensor, off: torch.Tensor, *,
             layer_ids: list[int] | None = None, last_only: bool = False):
        """Every row appends ids [B, q] at slots start[b]...; fixed shapes: graph-capturable."""
        q = ids.shape[1]
        qslot = (start[:, None] + torch.arange(q, device=self.device)[None]).clamp_max(self.slots - 1)
        # a transformers that refused the core's attention name runs plain sdpa: tensor masks
        flex = self.kernel == "flex" and getattr(self.model.config, "_attn_implementation", None) == DECODE
        if flex:
            mask = self._block_masks(qslot, off)
        else:
            mask = self._masks(qslot, off, qslot[:, -1] + 1, self.slots)
        if self.paged:  # flex reads the pages in place; sdpa each row's pages gathered
            self.cache.in_place = flex
        self.cache.begin_step(qslot)
        return self._run(ids, qslot - off[:, None], mask, layer_ids, 1 if last_only else 0)

    def attending(self) -> "attending":
        """Context every forward of the core runs in: the core's attention, the model's restored after."""
        return attending(self.model, self.attn)

    # ------------------------------------------------------------ graphs

    def graphed(self, fn: Callable[[], None]) -> Callable[[], None]:
        """`fn` as a replayable CUDA graph (itself on CPU); capture runs `fn`, so call before real state."""
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
        """Run `fn` once to compile flex; if that fails, decode with sdpa (warned) rather than not at all."""
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
        """Allocate every layer's K/V now, so that graphs captured next see the final buffers."""
        if len(self.cache) == 0:
            z = torch.zeros(1, dtype=torch.long, device=self.device)
            self.fresh(z, z[:, None], z)
