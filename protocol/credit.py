"""How much credit a consumer grants: its inbox, bounded in batches and in bytes.

Credit is the consumer's promise of room (PROTOCOL.md 4.5): the broker sends a batch only
against it, so what the consumer grants is what it may be sent. Two bounds decide it:

- at least `min_batches` (2): one batch to train while the next arrives;
- more while batches are small, up to `max_bytes` of them (never above `max_batches`):
  the credit must cover the round trip credit -> broker -> batch. With 640 MiB batches
  two are plenty; with 1 MiB batches two let the round trip, not the wire, set the rate
  (bench/transport.py at small credits, docs/BENCHMARKS.md).

The window follows the largest of the recent batches, so a mix of sizes is bounded by
its biggest. Credit is granted in lumps of a quarter window (at least one batch): with a
deep window the broker reads a credit message every few batches, not one per batch.
"""

from __future__ import annotations

from collections import deque

RECENT = 16  # batches whose size sets the window


class CreditWindow:
    def __init__(self, min_batches: int = 2, max_bytes: int | None = None, max_batches: int = 16):
        self.min_batches = max(1, min_batches)
        self.max_bytes = max_bytes
        self.max_batches = max(self.min_batches, max_batches)
        self.outstanding = 0  # granted, and no batch has come against it yet
        self._sizes: deque[int] = deque(maxlen=RECENT)
        self.window = self.min_batches

    def arrived(self, nbytes: int) -> None:
        """A batch came in (against one credit): note its size, resize the window."""
        self.outstanding = max(0, self.outstanding - 1)
        self._sizes.append(max(1, nbytes))
        if self.max_bytes is not None:
            fits = self.max_bytes // max(self._sizes)
            self.window = min(self.max_batches, max(self.min_batches, fits))

    def would_grant(self, held: int) -> bool:
        """Whether `to_grant(held)` would grant now (reads only: safe from another thread,
        where the answer may be a turn stale; the owner checks again after every event)."""
        return self.window - self.outstanding - held >= max(1, self.window // 4)

    def to_grant(self, held: int) -> int:
        """Credit to send now, with `held` batches received and not yet taken out.

        0 until a quarter window is free. Credit given cannot be taken back: after the
        window shrank (bigger batches), what was promised may still come, and nothing more
        is granted until what is held and promised fits the window again."""
        if not self.would_grant(held):
            return 0
        free = self.window - self.outstanding - held
        self.outstanding += free
        return free
