"""Out-of-memory handling: split the batch and retry; skip only a sequence that cannot fit.

A batch is split in two by the rule the consumer's step uses too (protocol/batch.py
`Batch.split`): whole consecutive sequences, about half the tokens each.

An OOM is logged with its cause (device, bytes asked, bytes free, tokens in the batch) and
never crashes the run. The retry happens outside the `except` block: the exception's
traceback holds the frames of the failed forward pass and their tensors, and memory only
comes back once it is gone.

After an OOM the splitter remembers the smallest batch that failed and splits batches of
that size up front (`oom_backoff` in the heartbeat), so a budget that is simply too large
for this GPU costs one failed pass, not one per batch.
"""

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
        # An OOM may be transient (fragmentation, a neighbour process): after this many
        # good passes the full budget is tried again.
        self.relax_after = relax_after
        self._ok = 0

    def run(self, batch: Batch) -> Iterator[Outcome]:
        """Outcomes in sequence order; each captured part is yielded as soon as it is ready,
        so the caller can send it before the next part occupies memory."""
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
