"""Batch staging: the next batch is made ready on a background thread while the current
step trains, so converting it and copying it to the GPU leave the critical path.

On CUDA a read batch goes from the frame views straight to the device on the stager's own
stream (fp8 dequantised there), with its host-side plan made too, so the training thread reads
nothing back to start a step. It reads ahead exactly one item: one is all the overlap needs,
and each more would hold another batch's GPU memory that the step itself may need."""

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

CLOSE_WAIT_S = 2.0  # the broker source returns every 0.5 s; a longer block is left to the daemon thread



@dataclass
class _Staged:

    kind: str  # "item" | "end" | "error"
    batch: Batch | None = None
    error: BaseException | None = None


class BatchStager:
    """Iterator of ready `Batch`es (or None) over `source`, one item read ahead on a thread
    started at the first `next()`. The source must not draw from torch's global RNG: the
    step draws from it at the same time."""

    def __init__(self, source: Iterable, device: torch.device, hidden_dtype: torch.dtype = torch.bfloat16,
                 prepare: Callable[[Batch], Batch] | None = None):
        self._source = iter(source)
        self._prepare = prepare  # the batch with host-side work for its step, on this thread (train.py: its plan)
        self.device, self.hidden_dtype = _with_index(torch.device(device)), hidden_dtype
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._cond = threading.Condition()
        self._slot: _Staged | None = None
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
        """Stop the thread (what it staged is dropped, never trained), within about CLOSE_WAIT_S."""
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
        """record_stream: the training thread frees a batch once its kernels are *queued*, and the
        allocator would hand that block to the stager's next copy while the main stream still reads it."""
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
            del item  # the frames can go now
            if not self._hand_over(staged) or staged.kind == "error":
                return

    def _wait_for_room(self) -> bool:
        """Block until the slot is free (one item ahead at most); False once closed."""
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
        # the step plans from host copies, never from the GPU
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
        # out of the except block (the failed copy's tensors are gone); the step copies the CPU
        # batch micro-batch by micro-batch instead (step_oom.py): slower, but trained
        batch = item.owned(self.hidden_dtype) if item.frames else item
        log.warning("train.stage_oom", batch_id=batch.batch_id, tokens=batch.tokens, device=str(self.device),
                    error=error)
        return batch

    def _to_device(self, item: Batch) -> Batch:
        """The item's tensors on the device via the stager's stream, synchronised before the handover."""
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            batch = item.owned(self.hidden_dtype, self.device) if item.frames else item.to(self.device)
        self._stream.synchronize()
        return batch


def _host_copies(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU (input_ids, loss_mask) of `batch` (copies of a read batch's frames, which go)."""
    if batch.frames:
        return batch.input_ids.clone(), batch.loss_mask.clone()
    return batch.input_ids.cpu(), batch.loss_mask.cpu()


def _with_index(device: torch.device) -> torch.device:
    """`cuda` as `cuda:N`: the stager thread's current device is 0 whatever the training thread set."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
