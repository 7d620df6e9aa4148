"""Varlen packing: whole sequences back to back, no padding, by token budget.

Position IDs restart per sequence, which transformers turns into attention that never crosses
a boundary; `check_packing` verifies that at start-up, since a family that ignored it would
silently leak context between sequences."""

from __future__ import annotations

from typing import Callable

import torch

from dflash.protocol.batch import Batch, position_ids
from dflash.protocol.errors import DFlashError

from .chat import Encoded


def pack(seqs: list[Encoded], token_budget: int, max_batch_size: int, *, lease: int = 0,
         epoch: int = 0) -> list[Batch]:
    """First-fit decreasing into batches of <= token_budget tokens and <= max_batch_size sequences
    (a longer sequence alone: the OOM path decides). Order within a lease means nothing to the broker."""
    if token_budget < 1 or max_batch_size < 1:
        raise ValueError("token_budget and max_batch_size must be positive")
    bins: list[list[Encoded]] = []
    room: list[int] = []
    for s in sorted((s for s in seqs if s.input_ids), key=lambda s: -len(s.input_ids)):
        n = len(s.input_ids)
        for b, free in enumerate(room):
            if n <= free and len(bins[b]) < max_batch_size:
                bins[b].append(s)
                room[b] -= n
                break
        else:
            bins.append([s])
            room.append(token_budget - n)
    return [_make(b, lease, epoch) for b in bins]


def _make(seqs: list[Encoded], lease: int, epoch: int) -> Batch:
    ids = [t for s in seqs for t in s.input_ids]
    mask = [m for s in seqs for m in s.loss_mask]
    return Batch.packed([s.sample for s in seqs], [len(s.input_ids) for s in seqs],
                        torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.uint8),
                        lease=lease, epoch=epoch)


class PackingError(DFlashError):
    """Packed sequences attend to each other on this model: packing would corrupt data."""

    def __init__(self, message: str, err: float | None = None, leak: float | None = None):
        super().__init__(message)
        self.err, self.leak = err, leak


def check_packing(capture: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], vocab_size: int,
                  lens: tuple[int, ...] = (7, 12, 5)) -> tuple[float, float]:
    """Relative errors of random sequences packed and unpacked vs alone; PackingError unless packed
    is far below unpacked (relative: bf16 noise varies by kernel, a leak is as big as unpacked's)."""
    err, leak = packing_errors(capture, vocab_size, lens)
    if err > 0.25 * leak:
        raise PackingError(f"packed and per-sequence hidden states differ (relative error {err:.3g}, "
                           f"{err / leak:.0%} of a full leak): this model/attention implementation does not "
                           "honour position-ID packing", err, leak)
    return err, leak


def packing_errors(capture: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], vocab_size: int,
                   lens: tuple[int, ...] = (7, 12, 5)) -> tuple[float, float]:
    """check_packing's two relative errors (packed vs alone, unpacked vs alone), not judged."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab_size, (n,), generator=g) for n in lens]
    ids = torch.cat(seqs)
    alone = torch.cat([capture(s, torch.arange(len(s))).float() for s in seqs])[lens[0]:]
    packed = capture(ids, position_ids(list(lens))).float()[lens[0]:]
    unpacked = capture(ids, torch.arange(len(ids))).float()[lens[0]:]
    return float((packed - alone).norm() / alone.norm()), float((unpacked - alone).norm() / alone.norm())
