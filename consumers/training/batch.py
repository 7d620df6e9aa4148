"""The batch a consumer trains on: the wire's batch (protocol/messages.py `Batch`, as the
link read it) with tensors of its own on the training device (or built locally).

The link's tensors are read-only views of ZeroMQ frames (PROTOCOL.md): `from_message`
converts them (fp8 is dequantised), so later in-place work never touches the frames.
The training loop usually gets its batches already converted, and already on the GPU,
from the stager (staging.py); a batch's tensors may live on any one device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dflash.protocol import messages
from dflash.protocol.errors import DFlashError
from dflash.protocol.fp8 import hidden_from_batch


class BatchMismatch(DFlashError):
    """A batch does not fit this drafter (other target layers or hidden size). `batch_id` and
    `fault` (layer_ids, hidden_width, seq_lens, token_ids) are set when the batch itself is at
    fault, not this consumer's options: the broker is told which batch (`failed`), and
    quarantines one that fails every consumer (PROTOCOL.md 4.2)."""

    def __init__(self, message: str, *, batch_id: str | None = None, fault: str | None = None):
        super().__init__(message)
        self.batch_id, self.fault = batch_id, fault


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
    # [T, H]: the target's last hidden state after its final norm (the LM head's input),
    # sent when producers run with --final-hidden; the soft labels of --distill-weight
    final_hidden: torch.Tensor | None = None
    # Host-side facts, made off the training thread by the stager (staging.py) so that the
    # step reads nothing back from the GPU: CPU copies of input_ids and loss_mask, the
    # token-ID range, and the step's plan (step.py `StepPlan`, for this whole batch only).
    host_input_ids: torch.Tensor | None = None
    host_loss_mask: torch.Tensor | None = None
    id_range: tuple[int, int] | None = None
    plan: object = None
    # the producer its header names (None: made locally): the one an error blames, not a
    # guess from the batch ID, whose form is the producer's own choice
    producer: str | None = None

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def from_message(cls, msg: messages.Batch, hidden_dtype: torch.dtype = torch.bfloat16,
                     device: torch.device | None = None) -> "Batch":
        """From a batch as the link read it (its tensors views of the frames), with tensors
        of its own: on `device` if given (the copy there is the only copy; fp8 is
        dequantised there), else copies on the CPU. Raises TypeError for anything else (a
        batch source yielding the wrong thing)."""
        if not isinstance(msg, messages.Batch):
            raise TypeError(f"expected a batch message, a Batch or None from the batch source, got "
                            f"{type(msg).__name__}")
        t = msg.tensors

        def own(frame: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
            x = frame if device is None else frame.to(device)
            x = x if dtype is None else x.to(dtype)
            return x.clone() if x.data_ptr() == frame.data_ptr() else x  # still a view of the frame

        hidden = hidden_from_batch(msg, hidden_dtype, device)
        if hidden.data_ptr() == t["hidden"].data_ptr():
            hidden = hidden.clone()
        final = own(t["final_hidden"], hidden_dtype) if "final_hidden" in t else None
        return cls(batch_id=msg.batch_id, samples=[int(s) for s in msg.samples],
                   seq_lens=[int(n) for n in msg.seq_lens], layer_ids=[int(i) for i in msg.layer_ids],
                   epoch=msg.epoch, input_ids=own(t["input_ids"]), loss_mask=own(t["loss_mask"]), hidden=hidden,
                   final_hidden=final, producer=msg.producer)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.input_ids, self.loss_mask, self.hidden

    def to(self, device: torch.device) -> "Batch":
        """The same batch with its tensors on `device` (this one if they are there already)."""
        return replace(self, input_ids=self.input_ids.to(device), loss_mask=self.loss_mask.to(device),
                       hidden=self.hidden.to(device),
                       final_hidden=None if self.final_hidden is None else self.final_hidden.to(device))

    def select(self, keep: list[int]) -> "Batch":
        """The same batch (same batch_id) with only the sequences at indices `keep`."""
        starts = [0]
        for n in self.seq_lens:
            starts.append(starts[-1] + n)
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in keep] or [torch.zeros(0, dtype=torch.long)])

        def pick(t: torch.Tensor) -> torch.Tensor:  # the index on the tensor's device (a staged batch: the GPU)
            return t[rows.to(t.device)]

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows]

        return Batch(self.batch_id, [self.samples[i] for i in keep], [self.seq_lens[i] for i in keep],
                     self.layer_ids, self.epoch, pick(self.input_ids), pick(self.loss_mask), pick(self.hidden),
                     None if self.final_hidden is None else pick(self.final_hidden),
                     host_input_ids=host(self.host_input_ids), host_loss_mask=host(self.host_loss_mask),
                     producer=self.producer)

    def with_host_facts(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> "Batch":
        """Set the host-side facts from CPU `input_ids` and `loss_mask` (this batch's, or the
        message's it was made from); returns self."""
        self.host_input_ids, self.host_loss_mask = input_ids, loss_mask
        if input_ids.numel():
            lo, hi = torch.aminmax(input_ids)
            self.id_range = (int(lo), int(hi))
        return self

    def check(self, layer_ids: list[int], hidden_size: int, vocab_size: int | None = None) -> None:
        """Raise BatchMismatch unless this batch carries `layer_ids` of width hidden_size
        and (given `vocab_size`) only token IDs in 0..vocab_size-1."""
        if self.layer_ids != list(layer_ids):
            raise BatchMismatch(
                f"batch {self.batch_id} carries target layers {self.layer_ids}, the drafter trains on {list(layer_ids)}",
                batch_id=self.batch_id, fault="layer_ids")
        if self.hidden.shape[1] != len(layer_ids) * hidden_size:
            raise BatchMismatch(
                f"batch {self.batch_id}: hidden width {self.hidden.shape[1]} != "
                f"{len(layer_ids)} layers x {hidden_size}", batch_id=self.batch_id, fault="hidden_width")
        if sum(self.seq_lens) != self.tokens or len(self.samples) != len(self.seq_lens):
            raise BatchMismatch(f"batch {self.batch_id}: seq_lens/samples disagree with {self.tokens} tokens",
                                batch_id=self.batch_id, fault="seq_lens")
        if vocab_size is not None and self.tokens:
            # The wire allows any int32: an ID past the vocabulary would crash the embedding
            # lookup (IndexError) or, on a GPU, fault the device, far from its cause.
            lo, hi = self.id_range or (int(x) for x in torch.aminmax(self.input_ids))
            if lo < 0 or hi >= vocab_size:
                made_by = f" (producer {self.producer})" if self.producer else ""
                raise BatchMismatch(f"batch {self.batch_id}{made_by} holds token "
                                    f"IDs {lo}..{hi}, outside this target's vocabulary 0..{vocab_size - 1}: its "
                                    "producer tokenises for another target, or the batch is corrupt",
                                    batch_id=self.batch_id, fault="token_ids")
