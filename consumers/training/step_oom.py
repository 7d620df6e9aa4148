"""Out of memory in a training step: split the batch into micro-batches, accumulate their
gradients, take the one optimizer step the whole batch would have taken.

Each sequence's loss terms depend on it alone (noise and anchors seeded per sample), so the
micro-batches' gradients add up to the whole batch's. An OOM throws the attempt away whole (a
partial backward may be in `.grad`) and retries, outside the `except` block, with twice the
micro-batches; a sequence that does not fit alone is an error, never silently dropped. The
count that worked is kept, and halved once after `relax_after` good steps (an OOM may be transient)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from dflash.consumers.drafter.loss import LossStats
from dflash.protocol.errors import DFlashError
from dflash.runtime.logs import get_logger
from dflash.runtime.memory import bytes_asked, memory_figures, release

from dflash.protocol.batch import Batch

log = get_logger()

ForwardBackward = Callable[[Batch], LossStats]  # forward + backward of one micro-batch, grads accumulate

# the CPU allocator and MPS raise a plain RuntimeError on OOM
_OOM_TEXT = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory",
             "MPS backend out of memory")


class SequenceTooLarge(DFlashError):
    """One sequence alone does not fit in memory for a training step."""


def is_oom(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(t in str(err) for t in _OOM_TEXT)


@dataclass
class OomInjection:
    """Test only: a micro-batch over `above_tokens` raises OutOfMemoryError after its backward (the
    worst case), at most `times` times; from DFLASH_TEST_OOM_TOKENS / _TIMES for a real process."""

    above_tokens: int
    times: int | None = None

    @classmethod
    def from_env(cls) -> "OomInjection | None":
        tokens = os.environ.get("DFLASH_TEST_OOM_TOKENS")
        if not tokens:
            return None
        times = os.environ.get("DFLASH_TEST_OOM_TIMES")
        try:
            inj = cls(int(tokens), int(times) if times else None)
        except ValueError:
            raise ValueError(f"DFLASH_TEST_OOM_TOKENS={tokens!r} / DFLASH_TEST_OOM_TIMES={times!r}: "
                             "whole numbers expected") from None
        log.warning("train.oom_injection", above_tokens=inj.above_tokens, times=inj.times)
        return inj

    def after_backward(self, part: Batch) -> None:
        if part.tokens <= self.above_tokens or self.times == 0:
            return
        if self.times is not None:
            self.times -= 1
        raise torch.OutOfMemoryError(f"out of memory (injected by DFLASH_TEST_OOM_TOKENS={self.above_tokens}: "
                                     f"a micro-batch of {part.tokens} tokens)")


@dataclass
class _Failure:
    part: Batch
    error: str
    asked: int | None


class StepSplitter:
    """Forward and backward of one step's batch, in as many micro-batches as memory needs."""

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device, *, relax_after: int = 200,
                 inject: OomInjection | None = None):
        self.params, self.device = params, device
        self.relax_after = relax_after
        self.inject = inject
        self.splits = 1  # micro-batches the next batch starts with
        self.ooms = 0
        self.last_splits = 1
        self._good = 0

    def run(self, batch: Batch, fwd_bwd: ForwardBackward, step: int) -> LossStats:
        """The batch's stats, its gradient summed into `.grad`; SequenceTooLarge if one sequence can't fit."""
        self._maybe_relax(step)
        k = min(self.splits, len(batch.seq_lens))
        while True:
            stats, failure = self._attempt(batch.split(k), fwd_bwd)
            if failure is None:
                self._good += 1
                self.last_splits = k
                return stats
            # out of the except block: the failed pass's tensors are unreachable now
            self._clear_grads()
            release(self.device)
            self.ooms += 1
            self._good = 0
            if len(failure.part.seq_lens) == 1:
                raise self._too_large(batch, failure, k, step)
            failed, k = k, min(2 * k, len(batch.seq_lens))
            self.splits = max(self.splits, k)  # a batch of few sequences never lowers it
            log.warning("train.oom_split", step=step, batch_id=batch.batch_id, tokens=batch.tokens,
                        sequences=len(batch.seq_lens), failed_splits=failed,
                        part_tokens=failure.part.tokens, part_sequences=len(failure.part.seq_lens), splits=k,
                        ooms=self.ooms, device=str(self.device), bytes_asked=failure.asked,
                        **memory_figures(self.device), error=failure.error)

    def heartbeat(self) -> dict:
        return {"oom_backoff": self.splits > 1, "ooms": self.ooms, "micro_batches": self.last_splits}

    def _attempt(self, parts: list[Batch], fwd_bwd: ForwardBackward) -> tuple[LossStats | None, _Failure | None]:
        total: LossStats | None = None
        for part in parts:
            try:
                stats = fwd_bwd(part)
                if self.inject is not None:
                    self.inject.after_backward(part)
            except RuntimeError as e:  # torch.OutOfMemoryError is one
                if not is_oom(e):
                    raise
                return None, _Failure(part, str(e).splitlines()[0][:300], bytes_asked(e))
            total = stats if total is None else total.add(stats)  # every figure is a sum
        return total, None

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def _maybe_relax(self, step: int) -> None:
        if self.splits > 1 and self._good >= self.relax_after:
            log.info("train.oom_relax", step=step, splits=self.splits // 2, was=self.splits, good_steps=self._good)
            self.splits //= 2
            self._good = 0

    def _too_large(self, batch: Batch, failure: _Failure, k: int, step: int) -> SequenceTooLarge:
        sample, length = failure.part.samples[0], failure.part.seq_lens[0]
        log.error("train.oom", step=step, batch_id=batch.batch_id, epoch=batch.epoch, sample=sample,
                  seq_len=length, tokens=batch.tokens, sequences=len(batch.seq_lens), splits=k,
                  device=str(self.device), bytes_asked=failure.asked, **memory_figures(self.device),
                  error=failure.error)
        return SequenceTooLarge(
            f"out of memory on {self.device} training sample {sample} (epoch {batch.epoch}, batch "
            f"{batch.batch_id}, step {step}): its {length} tokens do not fit even alone ({failure.error}); "
            "lower the producers' --max-length, or --anchors / --loss-chunk here, or use a larger GPU")
