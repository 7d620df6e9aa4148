"""Out-of-memory handling: split the batch and retry; skip only a sequence that cannot fit.

The retry runs outside the `except` block (the traceback holds the failed pass's tensors), and
the smallest failed size is split up front afterwards, so a too-large budget costs one failed pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from dflash.protocol.batch import Batch
from dflash.runtime.logs import get_logger
from dflash.runtime.memory import bytes_asked, bytes_free, release

log = get_logger()


@dataclass
class Outcome:
    """One result of `OomSplitter.run`: a captured (sub)batch, or a skipped sample."""

    batch: Batch | None = None
    hidden: torch.Tensor | None = None
    skipped: tuple[int, str] | None = None


class OomSplitter:
    """Runs `forward(batch) -> hidden` with split-and-retry on torch.OutOfMemoryError."""

    def __init__(self, forward: Callable[[Batch], torch.Tensor], device: torch.device,
                 relax_after: int = 200):
        self.forward = forward
        self.device = device
        self.ooms = 0
        self.skipped = 0
        self.backoff_tokens: int | None = None  # smallest batch that ran out of memory
        self.relax_after = relax_after  # an OOM may be transient: the full budget is tried again after this
        self._ok = 0

    def run(self, batch: Batch) -> Iterator[Outcome]:
        """Outcomes in order, each yielded at once so it is sent before the next part takes memory."""
        todo = [batch]
        while todo:
            b = todo.pop(0)
            if self.backoff_tokens is not None and b.tokens >= self.backoff_tokens and len(b.seq_lens) > 1:
                todo[:0] = b.split(2)
                continue
            failure = None
            try:
                hidden = self.forward(b)
            except torch.OutOfMemoryError as e:
                failure = (bytes_asked(e), str(e).splitlines()[0][:200])
            if failure is None:
                self._ok += 1
                if self.backoff_tokens is not None and self._ok >= self.relax_after:
                    log.info("produce.oom_backoff_end", tokens=self.backoff_tokens, good_passes=self._ok)
                    self.backoff_tokens = None
                yield Outcome(batch=b, hidden=hidden)
                continue
            # Out of the except block: the failed pass's tensors are unreachable now.
            release(self.device)
            self.ooms += 1
            self._ok = 0
            self.backoff_tokens = min(b.tokens, self.backoff_tokens or b.tokens)
            action = "split" if len(b.seq_lens) > 1 else "skip"
            log.warning("produce.oom", device=str(self.device), bytes_asked=failure[0],
                        bytes_free=bytes_free(self.device), tokens=b.tokens, seqs=len(b.seq_lens),
                        lease=b.lease, action=action, backoff_tokens=self.backoff_tokens, error=failure[1])
            if action == "split":
                todo[:0] = b.split(2)
            else:
                self.skipped += 1
                reason = f"oom: {b.tokens} tokens do not fit on {self.device}"
                log.error("produce.skip", sample=b.samples[0], lease=b.lease, tokens=b.tokens, reason=reason)
                yield Outcome(skipped=(b.samples[0], reason))
