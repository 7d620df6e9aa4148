"""A paged KV cache for the decoding core (decoding/core.py): one pool of fixed-size pages
per layer and a page table per row, so that a row holds the slots it uses (its own prompt
and its answer so far), not the longest prompt of its decoder plus the answer cap
(docs/REGENERATION.md "Rows: pages from a plan"). The idea is vLLM's PagedAttention.

Unheld table entries point at a scratch page (the pool's last), so free rows' step writes go
there and shapes stay fixed: a decode step stays one CUDA graph."""

from __future__ import annotations

import torch

from .cache import CacheStandIn


class PagedKV(CacheStandIn):
    """K/V pools [Hkv, (pages + 1) * page, hd] per layer; row b's logical slot s is at
    table[b, s // page] * page + s % page. Same modes as StaticKV."""

    def __init__(self, rows: int, width: int, page: int, pages: int, device: torch.device):
        if pages < 1 or width < 1 or page < 1:
            raise ValueError(f"paged KV: pages {pages}, width {width} and page size {page} must be >= 1")
        self.rows, self.width, self.page, self.pages = rows, width, page, pages
        self.slots = width * page  # logical slots of a row
        self.scratch = pages  # the physical page every unheld table entry points at
        self.table = torch.full((rows, width), pages, dtype=torch.long, device=device)
        # page -> holding row and logical block: uncompiled flex applies the mask alone, not the listed blocks
        self.owner = torch.full((pages + 1,), -1, dtype=torch.long, device=device)
        self.block_of = torch.zeros(pages + 1, dtype=torch.long, device=device)
        self._page_ar = torch.arange(page, device=device)
        self._index: dict = {}
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        self._write: torch.Tensor | None = None  # physical slots the forward's tokens go to (flat)
        self._read: torch.Tensor | None = None  # step with sdpa: [B, slots] physical slots in logical order
        self._step = False
        self.in_place = False  # step: hand attention the pool itself (flex), not gathered rows

    def index_buffer(self, kind, rows: int) -> torch.Tensor:
        """A kept block list per layer kind, a column per pool page (the compiled kernel asserts it)."""
        buf = self._index.get(kind)
        if buf is None or buf.shape[0] != rows:
            buf = self._index[kind] = torch.zeros(rows, 1, 1, self.pages + 1, dtype=torch.int32,
                                                  device=self.table.device)
        return buf

    def physical(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return self.table[rows, slots // self.page] * self.page + slots % self.page

    def begin_fresh(self, rows: torch.Tensor, off: torch.Tensor | None = None, width: int = 0) -> None:
        """Left-padded prompts into `rows` from logical slot 0 (padding goes to scratch)."""
        s = torch.arange(width, device=self.table.device)[None] - off[:, None]  # [R, W]
        phys = self.physical(rows[:, None], s.clamp_min(0))
        self._write = torch.where(s >= 0, phys, self.scratch * self.page).reshape(-1)
        self._step = False

    def begin_step(self, index: torch.Tensor) -> None:
        B = index.shape[0]
        self._write = self.physical(torch.arange(B, device=index.device)[:, None], index).reshape(-1)
        if not self.in_place:
            self._read = (self.table[:B, :, None] * self.page + self._page_ar).reshape(B, self.slots)
        self._step = True

    def begin_packed(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        self._write = self.physical(rows, slots)
        self._step = False

    def _alloc(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        while len(self.k) <= layer:
            self.k.append(None)
            self.v.append(None)
        if self.k[layer] is None:
            n = (self.pages + 1) * self.page
            self.k[layer] = k.new_zeros(k.shape[1], n, k.shape[3])
            self.v[layer] = v.new_zeros(v.shape[1], n, v.shape[3])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write; return the forward's own K/V (prefill), the pool (flex step) or rows gathered (sdpa step)."""
        self._alloc(layer_idx, key_states, value_states)
        K, V = self.k[layer_idx], self.v[layer_idx]
        H, hd = key_states.shape[1], key_states.shape[3]
        K[:, self._write] = key_states.transpose(0, 1).reshape(H, -1, hd)
        V[:, self._write] = value_states.transpose(0, 1).reshape(H, -1, hd)
        if not self._step:
            return key_states, value_states
        if self.in_place:
            return K[None], V[None]
        B = self._read.shape[0]
        read = self._read.reshape(-1)
        return (K[:, read].reshape(H, B, self.slots, hd).transpose(0, 1),
                V[:, read].reshape(H, B, self.slots, hd).transpose(0, 1))


def paged_block_masks(core, cache: PagedKV, qslot: torch.Tensor, off: torch.Tensor, g: int, block_mask, kinds):
    """Core._block_masks over the pool: row b lists its physical pages; the mask maps each slot
    back to its logical one (`block_of`) and applies the core's rule."""
    R, q = qslot.shape
    ps = cache.page
    ar = torch.arange(cache.width, device=qslot.device)
    out = {}
    for w in kinds:
        lo = off if w is None else torch.maximum(off, qslot[:, 0] - (w - 1))
        first = torch.div(lo, ps, rounding_mode="floor")
        last = torch.div(qslot[:, -1], ps, rounding_mode="floor")
        count = (last - first + 1).clamp_min(1).to(torch.int32)[:, None, None]
        logical = (first[:, None] + ar[None]).clamp_max(cache.width - 1)
        index = cache.index_buffer(w, R)  # [R, 1, 1, pages + 1]: flex wants a column per K/V block
        index[:, 0, 0, : cache.width] = cache.table[:R].gather(1, logical).to(torch.int32)
        out[w] = block_mask(count, index, (128, ps), _paged_visible(cache, qslot, off, w, q),
                            (g * q, (cache.pages + 1) * ps))
    return out


def _paged_visible(cache: PagedKV, qslot: torch.Tensor, off: torch.Tensor, window: int | None, q: int):
    owner, block_of, ps = cache.owner, cache.block_of, cache.page

    def mask_mod(b, h, q_idx, kv_idx):
        page = kv_idx // ps
        s = block_of[page] * ps + kv_idx % ps  # the logical slot of this physical one
        t = qslot[b, q_idx % q]
        vis = (owner[page] == b) & (s >= off[b]) & (s <= t)
        return vis if window is None else vis & (t - s < window)

    return mask_mod


class Pages:
    """The host's book of a PagedKV's pages (one batched device write per grant or release)."""

    def __init__(self, cache: PagedKV):
        self.cache = cache
        self.free: list[int] = list(range(cache.pages - 1, -1, -1))  # pop() gives the lowest first
        self.held: dict[int, list[int]] = {}
        self.peak = 0  # the most pages held at once so far

    @property
    def total(self) -> int:
        return self.cache.pages

    @property
    def used(self) -> int:
        return self.total - len(self.free)

    def pages_for(self, slots: int) -> int:
        return -(-slots // self.cache.page)

    def missing(self, row: int, slots: int) -> int:
        """Pages `row` lacks to hold logical slots 0..slots-1."""
        return max(0, self.pages_for(slots) - len(self.held.get(row, ())))

    def grow(self, wants: dict[int, int]) -> None:
        """Give each row of `wants` ({row: slots}) the pages it lacks (the caller checked there are enough)."""
        rows, blocks, pages = [], [], []
        for r, slots in wants.items():
            have = self.held.setdefault(r, [])
            for _ in range(self.missing(r, slots)):
                p = self.free.pop()
                rows.append(r)
                blocks.append(len(have))
                pages.append(p)
                have.append(p)
        if pages:
            self.peak = max(self.peak, self.used)
            dev = self.cache.table.device
            r, b, p = (torch.tensor(x, device=dev) for x in (rows, blocks, pages))
            self.cache.table[r, b] = p
            self.cache.block_of[p] = b
            self.cache.owner[p] = r

    def release(self, rows: list[int]) -> None:
        """Return the pages of `rows` to the pool; their table entries point at scratch."""
        back = [r for r in rows if self.held.get(r)]
        pages: list[int] = []
        for r in back:
            pages += self.held.pop(r)
        self.free.extend(reversed(pages))
        if back:
            dev = self.cache.table.device
            self.cache.table[torch.tensor(back, device=dev)] = self.cache.scratch
            self.cache.owner[torch.tensor(pages, device=dev)] = -1
