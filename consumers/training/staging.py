"""Batch staging: the next batch is made ready on a background thread while the current
step trains, so converting it and copying it to the GPU leave the critical path.

Without it, between two steps the training thread took the next message, cloned its
`hidden` on the CPU (dequantising fp8 there), and the step then copied it to the GPU from
pageable memory: a sizeable part of a step (docs/BENCHMARKS.md). `BatchStager` wraps the
batch source (items: a `Batch` as the link read it or made here, or None for "nothing
now") and hands out, in the source's order, `Batch`es that are ready to train:

- on CUDA, a read batch's tensors go from the frame views straight to the device (the H2D
  copy is the only copy, `Batch.owned`), on a CUDA stream of the stager's own so the copy
  overlaps the step's kernels on the main stream; fp8 (`fp8_e4m3_rowscale`) travels to
  the GPU as fp8 plus scales (half the bytes of bf16) and is dequantised there. A batch
  made here is copied to the device the same way;
- on other devices, exactly `Batch.owned` (a CPU clone), just on the thread; a batch made
  here passes as it is.

Either way the batch gets its host-side facts there (CPU copies of input_ids and
loss_mask, the token-ID range) and, given `prepare`, the step's host-side work (train.py:
anchors, the layout's indices, the loss's known figures): the training thread then reads
nothing back from the GPU to start a step.

None passes through as None at its position; the source's end is the end; an exception
of the source or of the conversion is raised in the consuming thread at its position.

It reads ahead by exactly one item: at most one staged batch exists besides the one
being trained. One is all the overlap needs (the next batch is ready when the step
ends), and every further one would hold another batch's worth of GPU memory that the
step itself may need (a bf16 batch of 12,288 tokens of 5 x 4096 features is 500 MB).
The broker sees one more delivered-but-unacked batch; one never trained (a stop, the
step limit) is returned by `bye` or the lost-consumer rule like the link's prefetched
ones (PROTOCOL.md 4.6, 6).

A None staged while a step runs says "nothing had arrived when the stager last asked":
the loop may take it (an empty step or a wait) although a batch arrived since, which
then comes with the next fetch. That costs at most one empty step when data resumes
after a starved spell, never a batch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from dflash.protocol.fp8 import FP8_DECODE_ROWS  # noqa: F401  (bench/gpu_checks.py reads it here)
from dflash.runtime.logs import get_logger
from dflash.runtime.threads import name_this_thread

from dflash.protocol.batch import Batch

log = get_logger()

# close() waits this long for the thread: the broker source returns None every 0.5 s, and
# a conversion takes well under a second. A source that blocks longer is left to return
# on the (daemon) thread, which then drops what it read and ends.
CLOSE_WAIT_S = 2.0



@dataclass
class _Staged:
    """What the thread hands over: one item, the end, or an exception."""

    kind: str  # "item" | "end" | "error"
    batch: Batch | None = None
    error: BaseException | None = None


class BatchStager:
    """Iterator of ready `Batch`es (or None) over `source`, one item read ahead on a thread.

    The thread starts at the first `next()`, so nothing is read before the loop asks.
    The source runs on that thread: it must not draw from torch's global RNG, which the
    step draws from at the same time (the broker link and the synthetic stream do not).
    Call `close()` (or use it as a context manager) when done with it."""

    def __init__(self, source: Iterable, device: torch.device, hidden_dtype: torch.dtype = torch.bfloat16,
                 prepare: Callable[[Batch], Batch] | None = None):
        self._source = iter(source)
        self._prepare = prepare  # the batch with host-side work for its step, on this thread (train.py: its plan)
        self.device, self.hidden_dtype = _with_index(torch.device(device)), hidden_dtype
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._cond = threading.Condition()
        self._slot: _Staged | None = None  # the staged item, None while empty
        self._closed = False
        self._done = False  # the end or an error was handed over: nothing more comes
        self._thread = threading.Thread(target=self._run, name="dflash-stager", daemon=True)

    def __iter__(self) -> "BatchStager":
        return self

    def __enter__(self) -> "BatchStager":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    # ------------------------------------------------ the consuming thread

    def __next__(self) -> Batch | None:
        staged = self._take()
        if staged.kind == "end":
            raise StopIteration
        if staged.kind == "error":
            raise staged.error
        if staged.batch is not None and self._stream is not None:
            self._use_on_current_stream(staged.batch)
        return staged.batch

    def close(self) -> None:
        """Stop the thread (what it staged or reads now is dropped, never trained).
        Returns within about CLOSE_WAIT_S even if the source blocks."""
        with self._cond:
            self._closed = True
            self._slot = None
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=CLOSE_WAIT_S)

    def _take(self) -> _Staged:
        if self._done or self._closed:
            return _Staged("end")
        if self._thread.ident is None:  # not started yet
            self._thread.start()
        with self._cond:
            while self._slot is None:
                if self._closed:  # closed by another thread meanwhile
                    return _Staged("end")
                if not self._thread.is_alive():  # cannot happen (it hands over its end or error): never hang
                    raise RuntimeError("the batch stager's thread ended without handing over its end")
                self._cond.wait(timeout=1.0)
            staged, self._slot = self._slot, None
            self._done = staged.kind != "item"
            self._cond.notify_all()  # the slot is free: the thread reads the next item
        return staged

    def _use_on_current_stream(self, batch: Batch) -> None:
        """The caching allocator ties each block to the stream it was allocated on (here the
        stager's) and reuses it as soon as the tensor is freed, for that stream's next
        allocation. The training thread frees a batch once it has *queued* the kernels
        that read it, not once they ran: without this, the stager could copy the next batch
        into that memory while the main stream still reads it. record_stream makes the
        allocator wait, on free, for the work queued on the main stream so far (the
        documented pattern for tensors used on another stream than their own)."""
        stream = torch.cuda.current_stream(self.device)
        for t in batch.tensors.values():
            if t.is_cuda:
                t.record_stream(stream)

    # ------------------------------------------------ the stager thread

    def _run(self) -> None:
        name_this_thread("dflash-stager")
        while self._wait_for_room():
            try:
                item = next(self._source)
            except StopIteration:
                self._hand_over(_Staged("end"))
                return
            except BaseException as e:  # raised in the consuming thread, at this position
                self._hand_over(_Staged("error", error=e))
                return
            try:
                staged = _Staged("item", batch=self._convert(item))
            except BaseException as e:
                staged = _Staged("error", error=e)
            del item  # the message's frames can go as soon as the copy is done
            if not self._hand_over(staged) or staged.kind == "error":
                return

    def _wait_for_room(self) -> bool:
        """Block until the slot is free (the consumer took the staged item): reading only
        then keeps it at one item ahead. False once closed."""
        with self._cond:
            while self._slot is not None and not self._closed:
                self._cond.wait()
            return not self._closed

    def _hand_over(self, staged: _Staged) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._slot = staged
            self._cond.notify_all()
            return True

    def _convert(self, item: Any) -> Batch | None:
        if item is None:
            return None
        if not isinstance(item, Batch):
            raise TypeError(f"expected a Batch or None from the batch source, got {type(item).__name__}")
        # The host copies of input_ids and loss_mask: the step plans from them, never from the GPU.
        host = _host_copies(item)
        batch = self._to_batch(item).with_host_facts(*host)
        if self._prepare is not None:
            if self._stream is not None:  # pinned host memory for the training device
                with torch.cuda.device(self.device):
                    batch = self._prepare(batch)
            else:
                batch = self._prepare(batch)
        return batch

    def _to_batch(self, item: Batch) -> Batch:
        if self._stream is None:
            return item.owned(self.hidden_dtype) if item.frames else item
        try:
            return self._to_device(item)
        except torch.OutOfMemoryError as e:
            error = str(e).splitlines()[0][:300]
        # Out of the except block, so the failed copy's tensors are gone (step_oom.py). The step
        # copies the CPU batch itself, micro-batch by micro-batch if memory is short
        # (step_oom.py): slower, but the batch is trained, and the consumer survives.
        batch = item.owned(self.hidden_dtype) if item.frames else item
        log.warning("train.stage_oom", batch_id=batch.batch_id, tokens=batch.tokens, device=str(self.device),
                    error=error)
        return batch

    def _to_device(self, item: Batch) -> Batch:
        """On the stager's stream: the item's tensors on the device, dequantised there.
        Synchronised before returning, so the copy is complete when the batch is handed
        over (and the frames may go)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            batch = item.owned(self.hidden_dtype, self.device) if item.frames else item.to(self.device)
        self._stream.synchronize()
        return batch


def _host_copies(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU (input_ids, loss_mask) of `batch`: copies of a read batch's frames (which go
    once it is converted), a batch made here's own tensors where they are on the CPU."""
    if batch.frames:
        return batch.input_ids.clone(), batch.loss_mask.clone()
    return batch.input_ids.cpu(), batch.loss_mask.cpu()


def _with_index(device: torch.device) -> torch.device:
    """`cuda` as `cuda:N` of the current device here: the stager thread's own current
    device is 0 whatever the training thread set."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
