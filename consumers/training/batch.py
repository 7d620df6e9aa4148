"""What a consumer asks of a batch (protocol/batch.py's `Batch`) before it trains on it."""

from __future__ import annotations

import torch

from dflash.protocol.batch import Batch
from dflash.protocol.errors import DFlashError



class BatchMismatch(DFlashError):
    """A batch does not fit this drafter; `batch_id` and `fault` are set when the batch itself is at
    fault, so the broker can quarantine it (PROTOCOL.md 4.2)."""

    def __init__(self, message: str, *, batch_id: str | None = None, fault: str | None = None):
        super().__init__(message)
        self.batch_id, self.fault = batch_id, fault


def check_fit(batch: Batch, layer_ids: list[int], hidden_size: int, vocab_size: int | None = None) -> None:
    """Raise BatchMismatch unless `batch` carries `layer_ids` of width hidden_size and
    (given `vocab_size`) only token IDs in 0..vocab_size-1."""
    bid = batch.batch_id
    if batch.layer_ids != list(layer_ids):
        raise BatchMismatch(f"batch {bid} carries target layers {batch.layer_ids}, the drafter trains on "
                            f"{list(layer_ids)}", batch_id=bid, fault="layer_ids")
    if batch.hidden.shape[1] != len(layer_ids) * hidden_size:
        raise BatchMismatch(f"batch {bid}: hidden width {batch.hidden.shape[1]} != {len(layer_ids)} layers x "
                            f"{hidden_size}", batch_id=bid, fault="hidden_width")
    tokens = int(batch.input_ids.shape[0])
    if batch.tokens != tokens or len(batch.samples) != len(batch.seq_lens):
        raise BatchMismatch(f"batch {bid}: seq_lens/samples disagree with {tokens} tokens", batch_id=bid,
                            fault="seq_lens")
    if vocab_size is not None and tokens:
        # the wire allows any int32: an ID past the vocabulary would fault the device far from its cause
        lo, hi = batch.id_range or (int(x) for x in torch.aminmax(batch.input_ids))
        if lo < 0 or hi >= vocab_size:
            made_by = f" (producer {batch.producer})" if batch.producer else ""
            raise BatchMismatch(f"batch {bid}{made_by} holds token IDs {lo}..{hi}, outside this target's "
                                f"vocabulary 0..{vocab_size - 1}: its producer tokenises for another target, "
                                "or the batch is corrupt", batch_id=bid, fault="token_ids")
