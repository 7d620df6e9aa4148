"""How much credit a consumer grants: its inbox, bounded in batches and in bytes (PROTOCOL.md 4.5).

At least `min_batches`; more while batches are small (up to `max_bytes` of the largest recent ones),
so the credit covers the round trip. Granted in lumps of a quarter window, not one per batch.
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
        """Whether `to_grant(held)` would grant now (read-only: safe, if a turn stale, from another thread)."""
        return self.window - self.outstanding - held >= max(1, self.window // 4)

    def to_grant(self, held: int) -> int:
        """Credit to send now, `held` batches waiting: 0 until a quarter window is free (credit given
        cannot be taken back, so a shrunk window waits for what was promised)."""
        if not self.would_grant(held):
            return 0
        free = self.window - self.outstanding - held
        self.outstanding += free
        return free
