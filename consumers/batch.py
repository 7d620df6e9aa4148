"""The batch a consumer trains on, made from a decoded `batch` message (or built locally).

Decoded tensors are read-only views of ZeroMQ frames (PROTOCOL.md): `from_message`
converts them (fp8 is dequantised), so later in-place work never touches the frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dflash.protocol.errors import DFlashError
from dflash.protocol.fp8 import hidden_from_batch


class BatchMismatch(DFlashError):
    """A batch does not fit this drafter (other target layers or hidden size)."""


@dataclass
class Batch:
    batch_id: str
    samples: list[int]  # dataset sample IDs, one per packed sequence
    seq_lens: list[int]  # packed back to back, sum = T
    layer_ids: list[int]  # target layers whose outputs are in `hidden`, in order
    epoch: int
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T], 1 on response tokens
    hidden: torch.Tensor  # [T, n_layers*H], bf16 (float32 allowed on CPU)

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def from_message(cls, msg: Any, hidden_dtype: torch.dtype = torch.bfloat16) -> "Batch":
        """From a `codec.Message` of type batch (already validated by the codec)."""
        h, t = msg.header, msg.tensors
        hidden = hidden_from_batch(h, t, hidden_dtype)
        if hidden.data_ptr() == t["hidden"].data_ptr():
            hidden = hidden.clone()  # same dtype: still a view of the frame
        return cls(
            batch_id=str(h["batch_id"]),
            samples=[int(s) for s in h["samples"]],
            seq_lens=[int(n) for n in h["seq_lens"]],
            layer_ids=[int(i) for i in h["layer_ids"]],
            epoch=int(h["epoch"]),
            input_ids=t["input_ids"].clone(),
            loss_mask=t["loss_mask"].clone(),
            hidden=hidden,
        )

    def select(self, keep: list[int]) -> "Batch":
        """The same batch (same batch_id) with only the sequences at indices `keep`."""
        starts = [0]
        for n in self.seq_lens:
            starts.append(starts[-1] + n)
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in keep] or [torch.zeros(0, dtype=torch.long)])
        return Batch(self.batch_id, [self.samples[i] for i in keep], [self.seq_lens[i] for i in keep],
                     self.layer_ids, self.epoch, self.input_ids[rows], self.loss_mask[rows], self.hidden[rows])

    def check(self, layer_ids: list[int], hidden_size: int) -> None:
        """Raise BatchMismatch unless this batch carries `layer_ids` of width hidden_size."""
        if self.layer_ids != list(layer_ids):
            raise BatchMismatch(
                f"batch {self.batch_id} carries target layers {self.layer_ids}, the drafter trains on {list(layer_ids)}"
            )
        if self.hidden.shape[1] != len(layer_ids) * hidden_size:
            raise BatchMismatch(
                f"batch {self.batch_id}: hidden width {self.hidden.shape[1]} != "
                f"{len(layer_ids)} layers x {hidden_size}"
            )
        if sum(self.seq_lens) != self.tokens or len(self.samples) != len(self.seq_lens):
            raise BatchMismatch(f"batch {self.batch_id}: seq_lens/samples disagree with {self.tokens} tokens")
