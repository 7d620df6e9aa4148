"""Anchors and the block layout of a packed batch: who attends to what.

Each anchor a starts a block of B queries at positions a..a+B-1, which see their own block
(both ways) and their own sequence's context strictly before a: at inference the anchor is the
fresh bonus token, whose target features do not exist yet. Nothing else."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

try:  # flex attention: block-sparse alternative to SDPA; absent on old torch builds
    from torch.nn.attention.flex_attention import flex_attention
except ImportError:  # pragma: no cover
    flex_attention = None


def anchor_seed(seed: int, epoch: int, sample_id: int) -> int:
    """Per (seed, epoch, sample): the same anchors whatever rank or packing, so data parallel
    training equals one process on the union, and a resume replays."""
    digest = hashlib.sha256(f"{seed}:{epoch}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def sample_anchors(loss_mask: torch.Tensor, block_size: int, n_anchors: int, seed: int, every: int = 1) -> torch.Tensor:
    """Sorted anchors of one sequence: response positions <= L - B, at most `n_anchors`, without replacement."""
    L = loss_mask.shape[0]
    valid = torch.nonzero(loss_mask[: max(L - block_size + 1, 0)], as_tuple=False).flatten()  # [n_valid]
    n = min(n_anchors, -(-valid.numel() // every))
    if n == 0:
        return valid.new_zeros(0)
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(valid.numel(), generator=g)[:n]
    return valid[pick].sort().values


@dataclass
class SeqSpan:
    """One sequence's slices in the packed context [T] and in the queries [Q]."""

    ctx_start: int
    ctx_len: int
    q_start: int
    q_len: int
    mask: torch.Tensor | None = None  # bool [q_len, ctx_len + q_len], for SDPA


@dataclass
class BlockLayout:
    block_size: int
    seq_lens: list[int]
    anchors: list[torch.Tensor]  # per sequence, positions within the sequence
    ctx_pos: torch.Tensor  # long [T]: position of each context token in its sequence
    q_pos: torch.Tensor  # long [Q]: absolute position of each block query (anchor + k)
    q_index: torch.Tensor  # long [Q]: index of that position in the packed batch
    spans: list[SeqSpan]
    backend: str = "sdpa"
    _block_mask: object = field(default=None, repr=False)
    # from a plan that knew the loss mask: rows with loss and their figures, sparing read-backs
    rows: torch.Tensor | None = None
    known: object = field(default=None, repr=False)
    # flex: each key's and query's sequence and the tile bounds, copied with the indices
    _flex_parts: dict | None = field(default=None, repr=False)
    # flex: empty keys after the context, so that the block keys start at a tile boundary
    key_pad: int = 0

    @property
    def context_keys(self) -> int:
        """Key rows before the block keys: the context and its padding."""
        return self.ctx_pos.shape[0] + self.key_pad

    def key_positions(self) -> torch.Tensor:
        """long [context_keys + Q]: the position of every key row (padding at 0; no query sees it)."""
        return torch.cat([self.ctx_pos, self.ctx_pos.new_zeros(self.key_pad), self.q_pos])

    @property
    def num_queries(self) -> int:
        return self.q_pos.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.num_queries // self.block_size

    def offsets(self) -> torch.Tensor:
        return torch.arange(self.num_queries, device=self.q_pos.device) % self.block_size

    def block_input_ids(self, input_ids: torch.Tensor, mask_token_id: int) -> torch.Tensor:
        """[anchor, MASK x (B-1)] per block, long [Q]."""
        # a select, not a boolean-mask assignment, which reads the mask back to size its result
        return torch.where(self.offsets() == 0, input_ids[self.q_index].long(), mask_token_id)

    def labels(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels, valid): position k predicts token anchor + k; k = 0 and non-response labels have no loss."""
        labels = input_ids[self.q_index].long()
        valid = (self.offsets() > 0) & loss_mask[self.q_index].bool()
        return labels, valid

    # ---------------------------------------------------------------- attention

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [Q, Hq, hd], k/v [context_keys + Q, Hkv, hd] (context, padding, blocks) -> [Q, Hq, hd]."""
        if self.backend == "flex":
            return _attend_flex(q, k, v, self._get_block_mask(q.device), scale)
        return _attend_sdpa(q, k, v, self.spans, sum(self.seq_lens), scale)

    def _get_block_mask(self, device: torch.device):
        if self._block_mask is None:  # built once per batch, shared by every layer
            self._block_mask = _flex_block_mask(self, device)
        return self._block_mask


@dataclass
class LayoutPlan:
    """The host half of a `BlockLayout`, made on the staging thread while the previous step trains;
    `to_device` is then one asynchronous copy, no read-back."""

    block_size: int
    seq_lens: list[int]
    anchors: list[torch.Tensor]
    backend: str
    spans: list[SeqSpan]  # SDPA masks still on the host
    flat: torch.Tensor  # long: the index vectors below, back to back
    sizes: dict[str, int]  # name -> length in `flat`, in order
    valid: torch.Tensor | None = None  # bool [Q], given the loss mask
    key: tuple = ()  # what the plan was made for (the caller's check that it still fits)
    key_pad: int = 0

    def to_device(self, device: torch.device) -> BlockLayout:
        flat = self.flat
        if device.type == "cuda":
            flat = flat.to(device, non_blocking=True)  # pinned: no wait on the host
        elif flat.device != device:
            flat = flat.to(device)
        parts = dict(zip(self.sizes, flat.split(list(self.sizes.values()))))
        spans = self.spans
        if device.type != "cpu":
            spans = [SeqSpan(s.ctx_start, s.ctx_len, s.q_start, s.q_len,
                             None if s.mask is None else s.mask.to(device, non_blocking=True)) for s in spans]
        flex = None
        if "bounds" in parts:
            bounds = parts["bounds"]
            flex = {"bounds": bounds.view(6, bounds.numel() // 6), "kv_seq": parts["kv_seq"], "q_seq": parts["q_seq"]}
        return BlockLayout(self.block_size, list(self.seq_lens), self.anchors, parts["ctx_pos"], parts["q_pos"],
                           parts["q_index"], spans, self.backend, rows=parts.get("rows"),
                           _flex_parts=flex, key_pad=self.key_pad)


def plan_layout(
    seq_lens: list[int], anchors: list[torch.Tensor], block_size: int, device: torch.device, backend: str = "sdpa",
    loss_mask: torch.Tensor | None = None,
) -> LayoutPlan:
    """The host half of a packed batch's layout (and, given `loss_mask`, the rows with loss)."""
    B = block_size
    ar = torch.arange(B)
    ctx_pos, q_pos, q_index, spans = [], [], [], []
    ctx_start = q_start = 0
    for L, a in zip(seq_lens, anchors):
        pos = (a[:, None] + ar[None, :]).flatten()  # [n_s * B]
        ctx_pos.append(torch.arange(L))
        q_pos.append(pos)
        q_index.append(pos + ctx_start)
        span = SeqSpan(ctx_start, L, q_start, pos.numel())
        if backend == "sdpa" and span.q_len:
            span.mask = _seq_mask(a, L, B)
            if device.type == "cuda":
                span.mask = span.mask.pin_memory()
        spans.append(span)
        ctx_start += L
        q_start += pos.numel()
    cat = [torch.cat(xs).long() if xs else torch.zeros(0, dtype=torch.long) for xs in (ctx_pos, q_pos, q_index)]
    named = {"ctx_pos": cat[0], "q_pos": cat[1], "q_index": cat[2]}
    valid, pad = None, 0
    if loss_mask is not None:
        lm = loss_mask.to("cpu")
        Q = cat[2].numel()
        valid = (torch.arange(Q) % B > 0) & lm[cat[2]].bool()
        named["rows"] = valid.nonzero()[:, 0]
    if backend == "flex":
        # a query tile's block keys then lie in as few key tiles as its queries (report: bench/flex_tiles.py)
        pad = -ctx_start % FLEX_BLOCK
        named["bounds"] = _flex_bounds(list(seq_lens), anchors, spans, ctx_start + pad, q_start, B).flatten()
        named["kv_seq"] = _sequence_of(list(seq_lens))
        named["q_seq"] = _sequence_of([s.q_len for s in spans])
    sizes = {k: v.numel() for k, v in named.items()}
    flat = torch.cat(list(named.values()))
    if device.type == "cuda":
        flat = flat.pin_memory()
    return LayoutPlan(B, list(seq_lens), anchors, backend, spans, flat, sizes, valid, key_pad=pad)


def build_layout(
    seq_lens: list[int], anchors: list[torch.Tensor], block_size: int, device: torch.device, backend: str = "sdpa",
    loss_mask: torch.Tensor | None = None,
) -> BlockLayout:
    """The layout of a packed batch given each sequence's anchors."""
    return plan_layout(seq_lens, anchors, block_size, device, backend, loss_mask).to_device(device)


def _seq_mask(anchors: torch.Tensor, L: int, B: int) -> torch.Tensor:
    """bool [n*B, L + n*B] for one sequence: context before the own anchor | own block."""
    n = anchors.numel()
    q_anchor = anchors.repeat_interleave(B)  # [n*B]
    q_block = torch.arange(n).repeat_interleave(B)  # [n*B]
    see_ctx = torch.arange(L)[None, :] < q_anchor[:, None]  # [n*B, L]
    see_blk = q_block[:, None] == q_block[None, :]  # [n*B, n*B]
    return torch.cat([see_ctx, see_blk], dim=1)


def _attend_sdpa(q, k, v, spans: list[SeqSpan], T: int, scale: float) -> torch.Tensor:
    # one SDPA call per sequence: the dense mask stays per sequence, not [Q, T + Q]
    outs = []
    for s in spans:
        if s.q_len == 0:
            continue
        ctx = slice(s.ctx_start, s.ctx_start + s.ctx_len)
        blk = slice(T + s.q_start, T + s.q_start + s.q_len)
        qs = q[s.q_start : s.q_start + s.q_len].transpose(0, 1)[None]  # [1, Hq, q_len, hd]
        ks = torch.cat([k[ctx], k[blk]]).transpose(0, 1)[None]  # [1, Hkv, L + q_len, hd]
        vs = torch.cat([v[ctx], v[blk]]).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=s.mask, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))  # [q_len, Hq, hd]
    if not outs:
        return q.new_zeros(q.shape)
    return torch.cat(outs)


# ---------------------------------------------------------------- flex attention (GPU)

_compiled_flex: Callable | None = None


def _flex_fn(device: torch.device) -> Callable:
    # uncompiled flex materialises the full score matrix: fine for CPU tests only
    global _compiled_flex
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex


FLEX_BLOCK = 128  # flex attention's tile, queries x keys


def _sequence_of(lens: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.long))


def _mask_mod(layout: BlockLayout, device: torch.device) -> Callable:
    """The element rule: context of the own sequence before the own anchor | the own block (padding: neither)."""
    T, K, Q, B = layout.ctx_pos.shape[0], layout.context_keys, layout.num_queries, layout.block_size
    parts = layout._flex_parts
    if parts is not None:  # copied with the layout's indices; own storage, as the compiled kernel always saw them
        kv_seq, q_seq = parts["kv_seq"].clone(), parts["q_seq"].clone()
    else:
        kv_seq = _sequence_of(layout.seq_lens).to(device)  # [T]
        q_seq = _sequence_of([s.q_len for s in layout.spans]).to(device)  # [Q]
    q_anchor = (layout.q_pos - layout.offsets()).to(device)  # [Q]
    q_block = torch.arange(Q, device=device) // B  # [Q], global block index
    kv_pos = layout.ctx_pos

    def mask_mod(b, h, qi, kvi):
        is_ctx = kvi < T
        ci = kvi.clamp(max=max(T - 1, 0))
        bi = (kvi - K).clamp(min=0)
        see_ctx = is_ctx & (kv_seq[ci] == q_seq[qi]) & (kv_pos[ci] < q_anchor[qi])
        see_blk = (kvi >= K) & (bi // B == q_block[qi])
        return see_ctx | see_blk

    return mask_mod


def _flex_bounds(seq_lens: list[int], anchors: list[torch.Tensor], spans: list[SeqSpan], T: int, Q: int,
                 B: int) -> torch.Tensor:
    """long [6, n_q] per query tile from the host-side anchors: its context and block key bounds
    (the block keys start at key row T)."""
    N = FLEX_BLOCK
    n_q = -(-Q // N)
    if n_q == 0:
        return torch.zeros(6, 0, dtype=torch.long)
    q_seq = torch.repeat_interleave(torch.arange(len(spans)), torch.tensor([s.q_len for s in spans]))
    ctx_start = torch.tensor([s.ctx_start for s in spans], dtype=torch.long)
    # Each query's anchor as a key index: non-decreasing in q (sorted anchors, packed in order)
    abs_anchor = torch.cat([a.long() + s.ctx_start for a, s in zip(anchors, spans)] or
                           [torch.zeros(0, dtype=torch.long)]).repeat_interleave(B)  # [Q]
    first = torch.arange(n_q) * N  # [n_q] the tile's first and last query
    last = torch.clamp(first + N, max=Q) - 1
    one_seq = (q_seq[first] == q_seq[last]) & (last - first + 1 == N)
    return torch.stack([ctx_start[q_seq[first]], abs_anchor[last], T + first // B * B, T + (last // B + 1) * B,
                        abs_anchor[first], one_seq.long()])


def tile_sets(bounds: torch.Tensor, T: int, KV: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [n_q, n_kv] each: the key tiles a query tile reaches only in part (the element rule
    decides) and wholly, from `_flex_bounds` over T context keys and KV keys in all."""
    N = FLEX_BLOCK
    c_lo, c_hi, k_lo, k_hi, f_hi, one = bounds[:, :, None]
    lo = torch.arange(-(-KV // N), device=bounds.device)[None, :] * N  # [1, n_kv] each key tile's bounds
    hi = torch.clamp(lo + N, max=KV)
    reach = ((lo < c_hi) & (hi > c_lo) & (lo < T)) | ((hi > k_lo) & (lo < k_hi))
    full = (one > 0) & (lo >= c_lo) & (hi <= f_hi) & (hi <= T)
    return reach & ~full, full


def _flex_block_mask(layout: BlockLayout, device: torch.device):
    """The BlockMask from tile bounds in O(tiles): create_block_mask would evaluate every
    (query, key) pair of the batch, O(Q x (T + Q)) per step."""
    if flex_attention is None:  # pragma: no cover
        raise RuntimeError("this torch build has no flex attention; use --attn sdpa")
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    T, Q, B, N = layout.ctx_pos.shape[0], layout.num_queries, layout.block_size, FLEX_BLOCK
    KV = layout.context_keys + Q
    if Q == 0:  # no query tile to describe
        return create_block_mask(_mask_mod(layout, device), None, None, 0, KV, device=device)
    # the bounds come from host-side anchors: no device tensor is read back
    if layout._flex_parts is not None:
        bounds = layout._flex_parts["bounds"]
    else:
        bounds = _flex_bounds(layout.seq_lens, layout.anchors, layout.spans, layout.context_keys, Q, B)
        if device.type == "cuda":
            bounds = bounds.pin_memory()
        bounds = bounds.to(device, non_blocking=True)
    partial, full = tile_sets(bounds, T, KV)

    def as_indices(m: torch.Tensor):  # [n_q, n_kv] bool -> counts [1, 1, n_q], indices [1, 1, n_q, n_kv]
        order = torch.argsort((~m).to(torch.int8), dim=1, stable=True)  # the tiles of m first, in order
        return m.sum(1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    (num, idx), (fnum, fidx) = as_indices(partial), as_indices(full)
    return BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=N, mask_mod=_mask_mod(layout, device),
                                    seq_lengths=(Q, KV))


def _attend_flex(q, k, v, block_mask, scale: float) -> torch.Tensor:
    o = _flex_fn(q.device)(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        block_mask=block_mask, scale=scale, enable_gqa=True,
    )  # [1, Hq, Q, hd]
    return o[0].transpose(0, 1)
