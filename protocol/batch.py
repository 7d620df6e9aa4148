"""The batch: whole sequences packed back to back, one type from a producer's packing to
a consumer's optimizer step (docs/DESIGN.md "The life of a batch").

Its fields are the `batch` message's header (PROTOCOL.md 5); beside them are its tensors
by name, each [T, ...] with T = sum(seq_lens):

- packed (producers/packing.py): `input_ids` int32 [T] and `loss_mask` uint8 [T]; no batch
  ID, producer or layers yet;
- captured (producers/producer.py): named, with `hidden` [T, n*H] on the host (fp8 with
  `hidden_scale` [T, n] under `fp8_e4m3_rowscale`) and, with --final-hidden, `final_hidden` [T, H];
- read off the wire (codec.decode_batch): the same tensors as read-only views of the
  ZeroMQ frames, which it keeps in `frames`; the broker makes no views and relays the frames;
- ready to train (`owned`): tensors of its own on the training device, hidden dequantised.

`select` keeps some of its sequences and `split` cuts it into consecutive parts: what the
consumer's exactly-once drops and both out-of-memory paths (the producer's capture, the
consumer's step) do to a batch. torch is imported where a tensor is made: the broker
holds batches without it.
"""

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, Iterable

from . import fp8
from .fields import Message, local, optional

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Batch(Message):
    """One batch (PROTOCOL.md 5): its header's fields and, beside them, its `tensors`."""

    type: ClassVar[str] = "batch"
    batch_id: str
    producer: str  # the peer ID of the producer that made it ("" while packing, or made locally)
    lease: int
    epoch: int
    samples: list  # dataset sample IDs, one per packed sequence
    seq_lens: list  # the sequences' lengths in order: sum = T
    layer_ids: list  # the target layers whose outputs `hidden` holds, in order
    hidden_encoding: str | None = optional()  # raw when absent, else fp8.ENCODING
    tensors: dict = local(default_factory=dict, repr=False, compare=False)
    frames: list = local(default_factory=list, repr=False, compare=False)  # what `tensors` are views of
    # A consumer's host-side facts, made by its stager off the training thread
    # (consumers/staging.py) so that a step reads nothing back from the GPU: CPU copies of
    # input_ids and loss_mask, the token-ID range, and the step's plan (consumers/step.py).
    host_input_ids: "torch.Tensor | None" = local(default=None, repr=False, compare=False)
    host_loss_mask: "torch.Tensor | None" = local(default=None, repr=False, compare=False)
    id_range: tuple | None = local(default=None, compare=False)
    plan: object = local(default=None, repr=False, compare=False)

    @classmethod
    def packed(cls, samples: list[int], seq_lens: list[int], input_ids: "torch.Tensor", loss_mask: "torch.Tensor",
               hidden: "torch.Tensor | None" = None, *, lease: int = 0, epoch: int = 0, batch_id: str = "",
               producer: str = "", layer_ids: Iterable[int] = (),
               final_hidden: "torch.Tensor | None" = None) -> "Batch":
        """A batch made here, not read off the wire: a producer's packed sequences, or (given
        `hidden`) a batch to train on as it is (the synthetic stream, tests)."""
        tensors = {"input_ids": input_ids, "loss_mask": loss_mask}
        if hidden is not None:
            tensors["hidden"] = hidden
        if final_hidden is not None:
            tensors["final_hidden"] = final_hidden
        return cls(batch_id, producer, lease, epoch, list(samples), list(seq_lens), list(layer_ids), tensors=tensors)

    @property
    def tokens(self) -> int:
        """T, the tokens packed in this batch (its sequences' lengths summed)."""
        return int(sum(self.seq_lens))

    @property
    def input_ids(self) -> "torch.Tensor":
        return self.tensors["input_ids"]  # int32 [T]

    @property
    def loss_mask(self) -> "torch.Tensor":
        return self.tensors["loss_mask"]  # uint8 [T]: 1 on the tokens trained on (the answers)

    @property
    def hidden(self) -> "torch.Tensor":
        return self.tensors["hidden"]  # [T, n_layers*H], as `hidden_encoding` says

    def position_ids(self) -> "torch.Tensor":
        """[T] int64: 0..len-1 for each sequence in turn (the target's positions, packed)."""
        return position_ids(self.seq_lens)

    @property
    def final_hidden(self) -> "torch.Tensor | None":
        """[T, H]: the target's last hidden state after its final norm (the LM head's input),
        sent by producers run with --final-hidden: the soft labels of --distill-weight."""
        return self.tensors.get("final_hidden")

    # ------------------------------------------------------------ some of its sequences

    def select(self, keep: Iterable[int]) -> "Batch":
        """The same batch (its ID, lease and epoch) with only its sequences at indices `keep`,
        in that order. Consecutive sequences are views of its tensors, others copies; each
        on the device its tensor is on."""
        keep = list(keep)
        starts = [0]
        for n in self.seq_lens:
            starts.append(starts[-1] + n)
        if keep and keep == list(range(keep[0], keep[-1] + 1)):
            rows = slice(starts[keep[0]], starts[keep[-1] + 1])

            def pick(t):
                return t[rows]
        else:
            import torch

            index = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in keep]
                              or [torch.zeros(0, dtype=torch.long)])

            def pick(t):
                return t[index.to(t.device)]

        def host(t):
            return None if t is None else pick(t)

        return replace(self, samples=[self.samples[i] for i in keep], seq_lens=[self.seq_lens[i] for i in keep],
                       tensors={name: pick(t) for name, t in self.tensors.items()}, raw={},
                       host_input_ids=host(self.host_input_ids), host_loss_mask=host(self.host_loss_mask),
                       id_range=None, plan=None)

    def split(self, k: int) -> list["Batch"]:
        """This batch as k parts of whole consecutive sequences, about T/k tokens each (k is
        capped at the number of sequences: no part is empty, no sequence is cut). The parts'
        tensors are views of this batch's. `split(1)` is [self], with what was made for it."""
        lens = self.seq_lens
        n, total = len(lens), sum(lens)
        k = max(1, min(k, n))
        if k == 1:
            return [self]
        cum = [0]
        for length in lens:
            cum.append(cum[-1] + length)
        cuts, start = [0], 0
        for g in range(1, k):
            target = total * g / k
            end = start + 1
            while end < n - (k - g) and cum[end] < target:  # leave a sequence for every later part
                end += 1
            if end - 1 > start and abs(cum[end - 1] - target) < abs(cum[end] - target):
                end -= 1
            cuts.append(end)
            start = end
        cuts.append(n)
        return [self.select(range(a, b)) for a, b in zip(cuts, cuts[1:])]

    # ------------------------------------------------------------ where its tensors live

    def to(self, device: "torch.device") -> "Batch":
        """The same batch with its tensors on `device` (the very tensors where they are there)."""
        return replace(self, tensors={name: t.to(device) for name, t in self.tensors.items()})

    def owned(self, hidden_dtype: "torch.dtype | None" = None, device: "torch.device | None" = None) -> "Batch":
        """The batch to train on: tensors of its own, never views of the frames (read-only,
        and gone once this is made), on `device` if given (the copy there is the only copy),
        else copies on the host; hidden states (and final_hidden) as `hidden_dtype` (bfloat16
        if None), fp8 dequantised where they arrive."""
        import torch

        dtype = hidden_dtype or torch.bfloat16
        t = self.tensors

        def own(x: "torch.Tensor", to: "torch.dtype | None" = None) -> "torch.Tensor":
            y = x if device is None else x.to(device)
            y = y if to is None else y.to(to)
            return y.clone() if y.data_ptr() == x.data_ptr() else y  # still the frame's memory

        hidden = self.hidden_as(dtype, device)
        tensors = {"input_ids": own(t["input_ids"]), "loss_mask": own(t["loss_mask"]),
                   "hidden": hidden.clone() if hidden.data_ptr() == t["hidden"].data_ptr() else hidden}
        if "final_hidden" in t:
            tensors["final_hidden"] = own(t["final_hidden"], dtype)
        return replace(self, hidden_encoding=None, tensors=tensors, frames=[])

    def hidden_as(self, dtype: "torch.dtype", device: "torch.device | None" = None) -> "torch.Tensor":
        """The hidden states as `dtype` (on `device`, else where they are), whatever encoding
        travelled (`hidden_encoding`). fp8 moves to the device as fp8 plus scales (half the
        bytes of bf16) and is dequantised there, FP8_DECODE_ROWS rows at a time. Raw hidden
        states of that dtype and device come back as the very tensor."""
        import torch

        def move(x: "torch.Tensor") -> "torch.Tensor":
            return x if device is None else x.to(device)

        if self.hidden_encoding != fp8.ENCODING:
            return move(self.tensors["hidden"]).to(dtype)  # the same dtype: no second copy
        q, scale = move(self.tensors["hidden"]), move(self.tensors["hidden_scale"])
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
        for a in range(0, q.shape[0], fp8.FP8_DECODE_ROWS):
            rows = slice(a, a + fp8.FP8_DECODE_ROWS)
            out[rows] = fp8.decode_fp8(q[rows], scale[rows], dtype)
        return out

    def with_host_facts(self, input_ids: "torch.Tensor", loss_mask: "torch.Tensor") -> "Batch":
        """This batch with its host-side facts from CPU `input_ids` and `loss_mask` (its own,
        or those of the frames it was made from)."""
        id_range = None
        if input_ids.numel():
            import torch

            lo, hi = torch.aminmax(input_ids)
            id_range = (int(lo), int(hi))
        return replace(self, host_input_ids=input_ids, host_loss_mask=loss_mask, id_range=id_range)


def position_ids(seq_lens: list[int]) -> "torch.Tensor":
    """[T] int64: 0..len-1 for each sequence in turn."""
    import torch

    lens = torch.tensor(seq_lens, dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    return torch.arange(int(lens.sum())) - torch.repeat_interleave(starts, lens)
