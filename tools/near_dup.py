"""Near-duplicate texts: the rule `dflash-prompts` keeps a prompt by.

The rule: two texts are near-duplicates when the Jaccard similarity of their sets of word
3-grams ("shingles": lowercased words, punctuation dropped) is at least `threshold` (0.6 by
default). A text of fewer than 3 words is one shingle, its whole word sequence. Exact
repeats (case, spacing and punctuation aside) have similarity 1.

Comparing every new text with every kept one would be quadratic, so candidates are found
by MinHash locality-sensitive hashing: 128 hash functions, in 32 bands of 4; a pair is a
candidate when one band of their signatures agrees (probability 1 - (1 - J^4)^32 for
similarity J: above 0.98 at J = 0.6, 1 at J = 1), and every candidate is confirmed by its
exact Jaccard similarity. So a reported near-duplicate always meets the rule; a pair at
the threshold escapes it with a probability under 2%, less above it.

Hashes are blake2b of each shingle (not Python's `hash`, which changes per process), so the
same texts give the same decisions on every run.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

SHINGLE_WORDS = 3
THRESHOLD = 0.6
BANDS, ROWS = 32, 4

_WORD = re.compile(r"\w+")
_PRIME = 4294967291  # the largest prime below 2^32: a x + b of 32-bit values fits in uint64


def shingles(text: str, n: int = SHINGLE_WORDS) -> frozenset[str]:
    """The set of word n-grams of `text` (lowercased words; a shorter text: one shingle)."""
    words = _WORD.findall(text.lower())
    if len(words) <= n:
        return frozenset([" ".join(words)])
    return frozenset(" ".join(words[i:i + n]) for i in range(len(words) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


class NearDupIndex:
    """Texts kept so far; `check(text)` says which kept text a new one near-duplicates, if any."""

    def __init__(self, threshold: float = THRESHOLD, *, bands: int = BANDS, rows: int = ROWS, seed: int = 0):
        if not 0 < threshold <= 1:
            raise ValueError(f"near-duplicate threshold {threshold} must be in (0, 1]")
        self.threshold, self.bands, self.rows = threshold, bands, rows
        rng = np.random.default_rng(seed)
        # h_i(x) = (a_i x + b_i) mod p over 32-bit shingle hashes: a universal family
        self._a = rng.integers(1, _PRIME, size=(bands * rows, 1), dtype=np.uint64)
        self._b = rng.integers(0, _PRIME, size=(bands * rows, 1), dtype=np.uint64)
        self.sets: list[frozenset] = []
        self._buckets: list[dict[bytes, list[int]]] = [{} for _ in range(bands)]

    def __len__(self) -> int:
        return len(self.sets)

    def _keys(self, sh: frozenset) -> list[bytes]:
        """The band keys of the MinHash signature of shingles `sh`."""
        x = np.array([int.from_bytes(hashlib.blake2b(s.encode(), digest_size=4).digest(), "little") for s in sh],
                     dtype=np.uint64)
        sig = ((self._a * x[None, :] + self._b) % np.uint64(_PRIME)).min(axis=1)
        return [sig[i * self.rows:(i + 1) * self.rows].tobytes() for i in range(self.bands)]

    def _find(self, sh: frozenset, keys: list[bytes]) -> tuple[int | None, float]:
        seen: set[int] = set()
        best, best_j = None, 0.0
        for band, key in zip(self._buckets, keys):
            for i in band.get(key, ()):
                if i not in seen:
                    seen.add(i)
                    j = jaccard(sh, self.sets[i])
                    if j > best_j:
                        best, best_j = i, j
        return (best, best_j) if best is not None and best_j >= self.threshold else (None, best_j)

    def _add(self, sh: frozenset, keys: list[bytes]) -> int:
        i = len(self.sets)
        self.sets.append(sh)
        for band, key in zip(self._buckets, keys):
            band.setdefault(key, []).append(i)
        return i

    def check(self, text: str) -> tuple[int | None, float]:
        """(index of the kept text `text` near-duplicates, their similarity), or (None, the
        best similarity among the candidates). Adds nothing."""
        sh = shingles(text)
        return self._find(sh, self._keys(sh))

    def add(self, text: str) -> int:
        """Keep `text` whatever it near-duplicates; returns its index."""
        sh = shingles(text)
        return self._add(sh, self._keys(sh))

    def keep(self, text: str) -> int | None:
        """Keep `text` unless it near-duplicates a kept text: None if kept, else that text's index."""
        sh = shingles(text)
        keys = self._keys(sh)
        dup, _ = self._find(sh, keys)
        if dup is None:
            self._add(sh, keys)
        return dup
