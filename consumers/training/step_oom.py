"""Out of memory in a training step: split the batch into micro-batches, accumulate their
gradients, take the one optimizer step the whole batch would have taken.

Same training signal: a step's loss is a sum of weighted CE over its sequences, divided by
the global loss weight only after every rank's sums are in (parallel/dist.py). Each sequence's
terms depend on that sequence alone (anchors and feature noise are seeded per sample,
attention stays inside a sequence), so the gradients of the micro-batches add up to the
gradient of the whole batch, and the step after the split is the step without it (up to
float summation order). tests/consumers/test_drafter_oom.py checks exactly that.

On an OOM the attempt is thrown away whole: the failed pass may have left gradients of a
partial backward in `.grad`, and they are mixed with those of the micro-batches done
before it, so every gradient is cleared and the step starts again with twice as many
micro-batches, cut by the rule the producer's capture uses too (protocol/batch.py
`Batch.split`: whole consecutive sequences, about equal in tokens; at most one sequence
per micro-batch in the end). A sequence that does not fit even alone is an error naming
it: skipping it would drop data silently, and the operator has to act (a shorter
--max-length at the producers, fewer --anchors, a smaller --loss-chunk, a bigger GPU).

The retry happens outside the `except` block: the exception's traceback holds the frames
of the failed pass and their tensors, and memory only comes back once it is gone.

The split is remembered: the next batches start with the micro-batch count that worked,
so a budget simply too large for this GPU costs one failed pass, not one per step. After
`relax_after` steps without an OOM the count is halved once to try bigger micro-batches
again (an OOM may have been transient: fragmentation, a neighbour process); if that fails
it costs one failed pass and the count doubles back.
"""

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

# Out-of-memory errors that are not torch.OutOfMemoryError: the CPU allocator and MPS raise
# a plain RuntimeError (CUDA and XPU raise torch.OutOfMemoryError).
_OOM_TEXT = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory",
             "MPS backend out of memory")


class SequenceTooLarge(DFlashError):
    """One sequence alone does not fit in memory for a training step."""


def is_oom(err: BaseException) -> bool:
    """Whether `err` is an allocator running out of memory, on any device."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(t in str(err) for t in _OOM_TEXT)


@dataclass
class OomInjection:
    """Test only: a micro-batch of more than `above_tokens` tokens raises
    torch.OutOfMemoryError after its backward (its gradients are in `.grad` then, the worst
    a real OOM late in a backward leaves), at most `times` times. From the environment:
    DFLASH_TEST_OOM_TOKENS=N [DFLASH_TEST_OOM_TIMES=M], so a real consumer process can be
    made to run out of memory in the real code path."""

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
    part: Batch  # the micro-batch that ran out of memory
    error: str  # the first line of the error
    asked: int | None  # bytes the failed allocation asked for


class StepSplitter:
    """Forward and backward of one step's batch, in as many micro-batches as memory needs."""

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device, *, relax_after: int = 200,
                 inject: OomInjection | None = None):
        self.params, self.device = params, device
        self.relax_after = relax_after
        self.inject = inject
        self.splits = 1  # micro-batches the next batch starts with
        self.ooms = 0  # OOMs survived, this process
        self.last_splits = 1  # micro-batches the last step ran in
        self._good = 0  # steps without an OOM since the last one

    def run(self, batch: Batch, fwd_bwd: ForwardBackward, step: int) -> LossStats:
        """The batch's stats; its gradient summed into `.grad` (cleared before this call).
        Raises SequenceTooLarge when one sequence alone runs out of memory."""
        self._maybe_relax(step)
        k = min(self.splits, len(batch.seq_lens))
        while True:
            stats, failure = self._attempt(batch.split(k), fwd_bwd)
            if failure is None:
                self._good += 1
                self.last_splits = k
                return stats
            # Out of the except block: the failed pass's tensors are unreachable now.
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
        """The heartbeat's OOM keys (PROTOCOL.md 4.2)."""
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
