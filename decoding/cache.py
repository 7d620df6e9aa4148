"""What the decoding core's caches (core.StaticKV, paged.PagedKV) show transformers besides `update`."""

from __future__ import annotations


class CacheStandIn:
    """Base of the core's caches (K/V lists `k`, `v`; positions and masks are passed explicitly)."""

    is_compileable = False  # transformers' generate() must not try to compile around it
    k: list
    v: list

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __len__(self) -> int:
        return len(self.k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)
