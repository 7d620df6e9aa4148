"""Anchors and the block layout of a packed batch: who attends to what.

A batch packs sequences back to back (T tokens). For each sequence s we draw anchors
among its response tokens; each anchor a starts one block of B query positions with
absolute positions a..a+B-1. A block's query may see:
  - context tokens of its own sequence at positions < a (strictly: at inference the
    drafter has target features only of tokens the target already processed, and the
    anchor is the freshly sampled bonus token whose features do not exist yet);
  - the B positions of its own block, in both directions.
Nothing else: not later context, not other blocks, not other sequences.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

try:  # flex attention: block-sparse alternative to SDPA; absent on old torch builds
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover
    create_block_mask = flex_attention = None


def anchor_seed(seed: int, epoch: int, sample_id: int) -> int:
    """Per (run seed, epoch, sample) seed: anchors are re-drawn each epoch, and the same
    sample gets the same anchors whichever rank or batch packing it lands in (so data
    parallel training equals single-process training on the union, and resume replays)."""
    digest = hashlib.sha256(f"{seed}:{epoch}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def sample_anchors(loss_mask: torch.Tensor, block_size: int, n_anchors: int, seed: int, every: int = 1) -> torch.Tensor:
    """Sorted anchor positions of one sequence: response tokens (loss_mask [L] true) at
    positions <= L - B, one per `every` of them and at most `n_anchors`, drawn without
    replacement."""
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

    @property
    def num_queries(self) -> int:
        return self.q_pos.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.num_queries // self.block_size

    def offsets(self) -> torch.Tensor:
        """k = position inside the block, long [Q]."""
        return torch.arange(self.num_queries, device=self.q_pos.device) % self.block_size

    def block_input_ids(self, input_ids: torch.Tensor, mask_token_id: int) -> torch.Tensor:
        """[anchor, MASK x (B-1)] per block, long [Q]."""
        ids = torch.full_like(self.q_index, mask_token_id)
        first = self.offsets() == 0
        ids[first] = input_ids[self.q_index[first]].long()
        return ids

    def labels(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels long [Q], valid bool [Q]). Block position k predicts token anchor + k;
        k = 0 is the given anchor (no loss); a label outside the response has no loss.
        Anchors <= L - B keep every label inside its sequence."""
        labels = input_ids[self.q_index].long()
        valid = (self.offsets() > 0) & loss_mask[self.q_index].bool()
        return labels, valid

    # ---------------------------------------------------------------- attention

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [Q, Hq, hd], k/v [T+Q, Hkv, hd] (context then blocks) -> [Q, Hq, hd]."""
        if self.backend == "flex":
            return _attend_flex(q, k, v, self._get_block_mask(q.device), scale)
        return _attend_sdpa(q, k, v, self.spans, sum(self.seq_lens), scale)

    def _get_block_mask(self, device: torch.device):
        if self._block_mask is None:  # built once per batch, shared by every layer
            self._block_mask = _flex_block_mask(self, device)
        return self._block_mask


def build_layout(
    seq_lens: list[int], anchors: list[torch.Tensor], block_size: int, device: torch.device, backend: str = "sdpa"
) -> BlockLayout:
    """The layout of a packed batch given each sequence's anchors."""
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
            span.mask = _seq_mask(a, L, B).to(device)
        spans.append(span)
        ctx_start += L
        q_start += pos.numel()
    cat = lambda xs: torch.cat(xs).long().to(device) if xs else torch.zeros(0, dtype=torch.long, device=device)
    return BlockLayout(B, list(seq_lens), anchors, cat(ctx_pos), cat(q_pos), cat(q_index), spans, backend)


def _seq_mask(anchors: torch.Tensor, L: int, B: int) -> torch.Tensor:
    """bool [n*B, L + n*B] for one sequence: context before the own anchor | own block."""
    n = anchors.numel()
    q_anchor = anchors.repeat_interleave(B)  # [n*B]
    q_block = torch.arange(n).repeat_interleave(B)  # [n*B]
    see_ctx = torch.arange(L)[None, :] < q_anchor[:, None]  # [n*B, L]
    see_blk = q_block[:, None] == q_block[None, :]  # [n*B, n*B]
    return torch.cat([see_ctx, see_blk], dim=1)


def _attend_sdpa(q, k, v, spans: list[SeqSpan], T: int, scale: float) -> torch.Tensor:
    # One SDPA call per sequence: sequences never see each other by construction, and the
    # dense mask stays [n_s*B, L_s + n_s*B] instead of [Q, T + Q] for the whole batch.
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
    # Without torch.compile flex attention materialises the full score matrix: fine for
    # CPU tests, hopeless for 100k queries on a GPU.
    global _compiled_flex
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex


def _flex_block_mask(layout: BlockLayout, device: torch.device):
    if create_block_mask is None:  # pragma: no cover
        raise RuntimeError("this torch build has no flex attention; use --attn sdpa")
    T, Q, B = layout.ctx_pos.shape[0], layout.num_queries, layout.block_size
    seq_of = lambda lens: torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.long))
    kv_seq = seq_of(layout.seq_lens).to(device)  # [T]
    q_seq = seq_of([s.q_len for s in layout.spans]).to(device)  # [Q]
    q_anchor = (layout.q_pos - layout.offsets()).to(device)  # [Q]
    q_block = torch.arange(Q, device=device) // B  # [Q], global block index
    kv_pos = layout.ctx_pos

    def mask_mod(b, h, qi, kvi):
        is_ctx = kvi < T
        ci = kvi.clamp(max=max(T - 1, 0))
        bi = (kvi - T).clamp(min=0)
        see_ctx = is_ctx & (kv_seq[ci] == q_seq[qi]) & (kv_pos[ci] < q_anchor[qi])
        see_blk = ~is_ctx & (bi // B == q_block[qi])
        return see_ctx | see_blk

    return create_block_mask(mask_mod, None, None, Q, T + Q, device=device, _compile=device.type == "cuda")


def _attend_flex(q, k, v, block_mask, scale: float) -> torch.Tensor:
    o = _flex_fn(q.device)(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        block_mask=block_mask, scale=scale, enable_gqa=True,
    )  # [1, Hq, Q, hd]
    return o[0].transpose(0, 1)
