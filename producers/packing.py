"""Varlen packing: whole sequences back to back, no padding, by token budget.

A forward pass gets at most `token_budget` tokens and `max_batch_size` sequences. Position
IDs restart at 0 for each sequence; with no attention mask and no cache, transformers
(5.x `masking_utils.find_packed_sequence_indices`, and the flash-attention varlen path via
`prepare_fa_kwargs_from_position_ids`) turns that into attention that never crosses a
sequence boundary: a block-diagonal causal mask for sdpa/eager, `cu_seqlens` for FA2.
`check_packing` verifies that on the loaded model at start-up, because a model family that
ignored it would silently leak context between sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dflash.protocol.errors import DFlashError

from .chat import Encoded


@dataclass
class PackedBatch:
    """Sequences of one lease packed back to back (T = sum(seq_lens) tokens)."""

    lease: int
    epoch: int
    samples: list[int]
    seq_lens: list[int]
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T]

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())

    def position_ids(self) -> torch.Tensor:
        return position_ids(self.seq_lens)

    def split(self) -> tuple["PackedBatch", "PackedBatch"]:
        """Two halves by sequence count (the OOM path). Raises ValueError on one sequence."""
        n = len(self.seq_lens)
        if n < 2:
            raise ValueError("a single sequence cannot be split")
        k = n // 2
        cut = sum(self.seq_lens[:k])
        return (
            PackedBatch(self.lease, self.epoch, self.samples[:k], self.seq_lens[:k],
                        self.input_ids[:cut], self.loss_mask[:cut]),
            PackedBatch(self.lease, self.epoch, self.samples[k:], self.seq_lens[k:],
                        self.input_ids[cut:], self.loss_mask[cut:]),
        )


def position_ids(seq_lens: list[int]) -> torch.Tensor:
    """[T] int64: 0..len-1 for each sequence in turn."""
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    return torch.arange(int(lens.sum())) - torch.repeat_interleave(starts, lens)


def pack(seqs: list[Encoded], token_budget: int, max_batch_size: int, *, lease: int = 0,
         epoch: int = 0) -> list[PackedBatch]:
    """First-fit decreasing into batches of <= token_budget tokens and <= max_batch_size
    sequences. A sequence longer than the budget gets a batch of its own (the OOM path
    decides whether it fits). Sorting by length fills batches better than arrival order;
    the order inside a lease means nothing to the broker, which lists samples per batch."""
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


def _make(seqs: list[Encoded], lease: int, epoch: int) -> PackedBatch:
    ids = [t for s in seqs for t in s.input_ids]
    mask = [m for s in seqs for m in s.loss_mask]
    return PackedBatch(
        lease=lease, epoch=epoch, samples=[s.sample for s in seqs],
        seq_lens=[len(s.input_ids) for s in seqs],
        input_ids=torch.tensor(ids, dtype=torch.int32), loss_mask=torch.tensor(mask, dtype=torch.uint8),
    )


class PackingError(DFlashError):
    """Packed sequences attend to each other on this model: packing would corrupt data."""

    def __init__(self, message: str, err: float | None = None, leak: float | None = None):
        super().__init__(message)
        self.err, self.leak = err, leak  # check_packing's relative errors, when it measured them


def check_packing(capture: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], vocab_size: int,
                  lens: tuple[int, ...] = (7, 12, 5)) -> tuple[float, float]:
    """Run a few random sequences packed, alone, and as one unpacked sequence; return the
    relative errors (packed vs alone, unpacked vs alone) over the sequences after the first
    (the ones a leak would reach).

    Raises PackingError if that error is not far below the error that attention across the
    boundaries produces (the unpacked run). A relative criterion, because the numerical
    noise of a deep bf16 model differs by kernel and shape while a leak is of the same size
    as the unpacked run's difference."""
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
