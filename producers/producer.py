"""The producer loop: leases in, packed hidden-state batches out.

Prefetch thread -> bounded queue -> capture on the main thread -> sink; source and sink are
plugged in (broker_work.py, or local ones for tests and `--dry-run`). Batches never mix leases."""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict, deque
from dataclasses import replace
from typing import Callable, Iterator, Protocol

import torch

from dflash.protocol.batch import Batch
from dflash.protocol.fp8 import ENCODING as FP8_ENCODING, encode_fp8
from dflash.runtime.gpu import gpu_figures
from dflash.runtime.logs import get_logger

from .chat import ChatEncoder
from .data import BadRow, DataSource, Row
from .capture_oom import OomSplitter
from .packing import pack
from .prefetch import Item, Lease, Prefetcher
from .regen_ahead import RegenAhead
from .regenerate import Regenerator, count_endings
from .target import Target

log = get_logger()

# Takes each batch the producer built. May block: that is backpressure.
BatchSink = Callable[[Batch], None]


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy through pinned memory: a pageable copy can outlast the forward pass (docs/BENCHMARKS.md)."""
    if not t.is_cuda:
        return t.contiguous()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return out


class WorkSource(Protocol):
    def next_lease(self) -> Lease | None:
        """The next lease, blocking until there is one; None when no work is left."""

    def lease_done(self, lease: int, skipped: list[tuple[int, str]]) -> None:
        """Every batch of `lease` went to the sink; `skipped` are (sample, reason) pairs."""


class LocalWorkSource:
    """Leases over rows 0..n-1 in order, for `epochs` epochs (tests, `--dry-run`)."""

    def __init__(self, n_rows: int, lease_size: int = 256, epochs: int = 1):
        self._leases = [Lease(k, e, list(range(s, min(s + lease_size, n_rows))))
                        for k, (e, s) in enumerate((e, s) for e in range(epochs)
                                                   for s in range(0, n_rows, lease_size))]
        self.done: dict[int, list[tuple[int, str]]] = {}

    def next_lease(self) -> Lease | None:
        return self._leases.pop(0) if self._leases else None

    def order(self) -> list[int]:
        """The first epoch's lease order, for --regenerate to work ahead."""
        return [s for le in self._leases if le.epoch == self._leases[0].epoch for s in le.samples] \
            if self._leases else []

    def lease_done(self, lease: int, skipped: list[tuple[int, str]]) -> None:
        self.done[lease] = list(skipped)


class Producer:
    """Runs leases from `source` through `target` into `sink`; batches are named `<name>-N`."""

    def __init__(self, target: Target, dataset: DataSource, encoder: ChatEncoder, source: WorkSource,
                 sink: BatchSink, *, token_budget: int, max_batch_size: int, prefetch: int = 4,
                 skip_bad_rows: bool = False, hidden_encoding: str = "raw",
                 regenerator: Regenerator | None = None, regen_ahead: int = 0,
                 forward: Callable[[Batch], torch.Tensor] | None = None, name: str = "local"):
        self.target, self.dataset, self.encoder, self.name = target, dataset, encoder, name
        self._batch_seq = itertools.count()
        self.source, self.sink, self.regenerator = source, sink, regenerator
        self.token_budget, self.max_batch_size = token_budget, max_batch_size
        self.skip_bad_rows, self.hidden_encoding = skip_bad_rows, hidden_encoding
        self.regen_ahead = regen_ahead
        self.ahead: RegenAhead | None = None  # the regeneration thread, with regen_ahead > 0 (run)
        # `forward` is replaceable so tests can inject failures around the real capture.
        self.splitter = OomSplitter(forward or self._forward, target.device)
        self.prefetcher = Prefetcher(source.next_lease, self.prepare, depth=prefetch)
        # A plain dict with every key up front: the heartbeat reads it from the I/O thread.
        self.counts = dict.fromkeys(("batches", "tokens", "samples", "leases", "skipped", "bad_rows",
                                     "answers_dropped"), 0)
        self._window: deque[tuple[float, int, int]] = deque(maxlen=64)  # (t, tokens, batches)
        self._t0 = time.monotonic()
        self.state = "starting"
        # Set (by a signal handler) to stop after the batch in hand: no new lease, no new
        # batch; what was leased and not pushed goes back to the broker with `bye`.
        self.stop = threading.Event()

    # ------------------------------------------------------------ prefetch thread

    def prepare(self, lease: Lease) -> tuple[list[Batch], list[tuple[int, str]]]:
        """Read, tokenise and pack one lease. Raises BadRow unless --skip-bad-rows."""
        skipped: list[tuple[int, str]] = []
        rows: list[Row] = []
        for sample in lease.samples:
            try:
                row = self.dataset.read(sample)
                if self.regenerator is not None:
                    self.regenerator.check(row)  # a row it cannot regenerate is a bad row, not a failed lease
                rows.append(row)
            except BadRow as e:
                skipped.append(self._bad_row(e))
        if self.ahead is not None:
            return self._stream(lease, rows, skipped), skipped
        if self.regenerator is not None:
            rows = self.regenerator.apply(rows)
        encoded = [e for e in (self._encode(row, skipped) for row in rows) if e is not None]
        return pack(encoded, self.token_budget, self.max_batch_size, lease=lease.lease, epoch=lease.epoch), skipped

    def _encode(self, row: Row, skipped: list[tuple[int, str]]):
        """The row's Encoded, or None (reported in `skipped`)."""
        why = self.regenerator.drop_reason(row) if self.regenerator is not None and row.endings else None
        if why is not None:  # --regen-drop: an answer ended in a way not trained; skipped and reported
            self.counts["answers_dropped"] += 1
            log.info("produce.answer_dropped", sample=row.sample, source=row.source, endings=list(row.endings),
                     reason=why.split(":", 1)[0], answers_dropped=self.counts["answers_dropped"])
            skipped.append((row.sample, why))
            return None
        try:
            enc = self.encoder.encode(row)
        except BadRow as e:
            skipped.append(self._bad_row(e))
            return None
        if not any(enc.loss_mask):
            # Legal but useless: truncation cut every assistant token. Reported, not dropped.
            log.warning("produce.empty_row", sample=row.sample, source=row.source, tokens=len(enc.input_ids),
                        truncated=enc.truncated, reason="no_loss_tokens")
            skipped.append((row.sample, "no_loss_tokens: no assistant token within --max-length"))
            return None
        return enc

    def _stream(self, lease: Lease, rows: list[Row], skipped: list[tuple[int, str]]) -> Iterator[Batch]:
        """A lease's batches as its rows get regenerated: each goes once ready rows fill it."""
        t0 = time.monotonic()
        chats = {r.sample: r for r in rows if r.messages is not None}
        have = self.ahead.request(list(chats.values()))
        cached = len(have)
        acc = [e for e in (self._encode(r, skipped) for r in rows if r.messages is None) if e is not None]
        waiting = set(chats) - set(have)
        ready = have
        regs = []
        while True:
            for s, reg in ready.items():
                regs.append(reg)
                enc = self._encode(reg.row(chats[s]), skipped)
                if enc is not None:
                    acc.append(enc)
            if not waiting:
                break
            if sum(len(e.input_ids) for e in acc) >= self.token_budget or len(acc) >= self.max_batch_size:
                batches = pack(acc, self.token_budget, self.max_batch_size, lease=lease.lease, epoch=lease.epoch)
                keep = min(batches, key=lambda b: b.tokens)  # the emptiest waits for more rows
                for b in batches:
                    if b is not keep:
                        yield b
                acc = [e for e in acc if e.sample in set(keep.samples)]
            ready = self.ahead.wait(waiting, timeout_s=1.0)
            waiting -= set(ready)
        made, new_tokens = self.ahead.made_here(chats)
        log.info("produce.regen", rows=len(chats), cached=len(chats) - made, generated=made, new_tokens=new_tokens,
                 gen_s=round(time.monotonic() - t0, 3), ready=cached, endings=count_endings(regs))
        yield from pack(acc, self.token_budget, self.max_batch_size, lease=lease.lease, epoch=lease.epoch)

    def _bad_row(self, e: BadRow) -> tuple[int, str]:
        if not self.skip_bad_rows:
            raise e
        self.counts["bad_rows"] += 1
        log.warning("produce.bad_row", sample=e.sample, source=e.source, reason=e.reason,
                    bad_rows=self.counts["bad_rows"])
        return (e.sample, f"bad_row: {e.source}: {e.reason}")

    # ------------------------------------------------------------ main thread

    def _forward(self, batch: Batch) -> torch.Tensor:
        hidden = self.target.capture(batch.input_ids.long(), batch.position_ids())
        if hidden.is_cuda:
            torch.cuda.synchronize(hidden.device)  # so fwd_ms is the pass, not its launch
        return hidden

    def run(self) -> dict:
        """Produce until the source has no more work; the summary counts."""
        self.state = "producing"
        if self.regenerator is not None and self.regen_ahead > 0:
            order = getattr(self.source, "order", lambda: None)()
            self.ahead = RegenAhead(self.regenerator, self.dataset, ahead=self.regen_ahead, order=order)
            self.ahead.start()
        self.prefetcher.start()
        oom_skipped: dict[int, list[tuple[int, str]]] = defaultdict(list)
        try:
            while not self.stop.is_set():
                t_wait = time.monotonic()
                item: Item = self.prefetcher.get()
                wait_s = time.monotonic() - t_wait
                if item.kind == "error":
                    raise item.error
                if item.kind == "end":
                    break
                if item.kind == "lease_end":
                    lease = item.lease
                    skipped = item.skipped + oom_skipped.pop(lease.lease, [])
                    self.source.lease_done(lease.lease, skipped)
                    self.counts["leases"] += 1
                    self.counts["skipped"] += len(skipped)
                    log.info("produce.lease_done", lease=lease.lease, epoch=lease.epoch,
                             samples=len(lease.samples), skipped=len(skipped))
                    continue
                t_fwd = time.monotonic()
                for out in self.splitter.run(item.batch):
                    if out.skipped is not None:
                        oom_skipped[item.batch.lease].append(out.skipped)
                    else:
                        self._emit(out.batch, out.hidden, wait_s, time.monotonic() - t_fwd)
                        wait_s = 0.0
                    t_fwd = time.monotonic()
        finally:
            self.state = "done"
            self.prefetcher.stop()
            if self.ahead is not None:
                self.ahead.stop()
        return self.summary()

    def _emit(self, batch: Batch, hidden: torch.Tensor, wait_s: float, fwd_s: float) -> None:
        t0 = time.monotonic()
        tensors = {"input_ids": batch.input_ids, "loss_mask": batch.loss_mask}
        encoding, final = None, None
        if self.target.final_norm is not None:  # --final-hidden: the last slot travels as its own tensor
            n_h = len(self.target.layer_ids) * self.target.hidden_size
            hidden, final = hidden[:, :n_h].contiguous(), to_host(hidden[:, n_h:].contiguous())
        if self.hidden_encoding == FP8_ENCODING:
            # Encoded on the GPU: half the bytes cross PCIe and the wire.
            q, scale = encode_fp8(hidden, len(self.target.layer_ids))
            tensors["hidden"], tensors["hidden_scale"] = to_host(q), to_host(scale)
            encoding = FP8_ENCODING
        else:
            tensors["hidden"] = to_host(hidden)  # [T, n*H]
        if final is not None:
            tensors["final_hidden"] = final  # [T, H], the model dtype (never fp8: it makes soft labels)
        del hidden
        batch_id = f"{self.name}-{next(self._batch_seq)}"
        out = replace(batch, batch_id=batch_id, producer=self.name, layer_ids=list(self.target.layer_ids),
                      hidden_encoding=encoding, tensors=tensors)
        t1 = time.monotonic()
        self.sink(out)
        t2 = time.monotonic()
        self.counts["batches"] += 1
        self.counts["tokens"] += batch.tokens
        self.counts["samples"] += len(batch.samples)
        self._window.append((t2, batch.tokens, 1))
        log.info("produce.batch", batch_id=batch_id, lease=batch.lease, epoch=batch.epoch,
                 seqs=len(batch.samples), tokens=batch.tokens, loss_tokens=int(batch.loss_mask.sum()),
                 fwd_ms=round(fwd_s * 1e3, 1), d2h_ms=round((t1 - t0) * 1e3, 1), push_ms=round((t2 - t1) * 1e3, 1),
                 wait_ms=round(wait_s * 1e3, 1), q_pre=self.prefetcher.depth(),
                 tokens_per_s=round(self.tokens_per_s()))

    # ------------------------------------------------------------ figures

    def tokens_per_s(self) -> float:
        if len(self._window) < 2:
            return 0.0
        span = self._window[-1][0] - self._window[0][0]
        return sum(n for _, n, _ in list(self._window)[1:]) / span if span > 0 else 0.0

    def stats(self) -> dict:
        """Heartbeat figures (PROTOCOL.md 4.2 producer keys), safe to call from any thread."""
        s = {"state": self._state(), "q_pre": self.prefetcher.depth(), "tokens_per_s": round(self.tokens_per_s(), 1),
             "batches_per_s": round(self._batches_per_s(), 3), "oom_backoff": self.splitter.backoff_tokens is not None,
             "batches": self.counts["batches"], "tokens": self.counts["tokens"], "samples": self.counts["samples"],
             "skipped": self.counts["skipped"], "bad_rows": self.counts["bad_rows"], "ooms": self.splitter.ooms}
        s.update(gpu_figures(self.target.device))  # memory (+ utilisation with NVML); {} on CPU
        return s

    def _state(self) -> str:
        if self.state != "producing":
            return self.state
        return "producing" if self.prefetcher.depth() else f"prefetch_{self.prefetcher.state}"

    def _batches_per_s(self) -> float:
        if len(self._window) < 2:
            return 0.0
        span = self._window[-1][0] - self._window[0][0]
        return (len(self._window) - 1) / span if span > 0 else 0.0

    def summary(self) -> dict:
        elapsed = time.monotonic() - self._t0
        return {**self.counts, "ooms": self.splitter.ooms, "elapsed_s": round(elapsed, 3),
                "tokens_per_s": round(self.counts["tokens"] / elapsed, 1) if elapsed > 0 else 0.0}
