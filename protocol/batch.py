"""The batch: whole sequences packed back to back, one type from a producer's packing to a
consumer's optimizer step (docs/DESIGN.md "The life of a batch").

Its fields are the `batch` header (PROTOCOL.md 5); beside them its tensors, each [T, ...] with
T = sum(seq_lens): packed, captured, read off the wire as views of the frames, or `owned` to train.
torch is imported where a tensor is made: the broker holds batches without it.
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
    # host-side facts made off the training thread, so a step reads nothing back from the GPU
    host_input_ids: "torch.Tensor | None" = local(default=None, repr=False, compare=False)
    host_loss_mask: "torch.Tensor | None" = local(default=None, repr=False, compare=False)
    id_range: tuple | None = local(default=None, compare=False)
    plan: object = local(default=None, repr=False, compare=False)

    @classmethod
    def packed(cls, samples: list[int], seq_lens: list[int], input_ids: "torch.Tensor", loss_mask: "torch.Tensor",
               hidden: "torch.Tensor | None" = None, *, lease: int = 0, epoch: int = 0, batch_id: str = "",
               producer: str = "", layer_ids: Iterable[int] = (),
               final_hidden: "torch.Tensor | None" = None) -> "Batch":
        """A batch made here, not read off the wire: packed sequences, or with `hidden` one to train on."""
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
        """[T, H]: the target's LM-head input (--final-hidden), the soft labels of --distill-weight."""
        return self.tensors.get("final_hidden")

    # ------------------------------------------------------------ some of its sequences

    def select(self, keep: Iterable[int]) -> "Batch":
        """The same batch with only its sequences at indices `keep` (views where consecutive, else copies)."""
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
        """This batch as up to k non-empty parts of whole consecutive sequences, about T/k tokens each (views)."""
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
        """The batch to train on: tensors of its own (never views of the read-only frames), on `device`
        if given, hidden states as `hidden_dtype` (bfloat16 if None)."""
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
        """The hidden states as `dtype` on `device`; fp8 travels to the device as fp8 (half the bytes)
        and is dequantised there in chunks."""
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
        """This batch with its host-side facts from CPU `input_ids` and `loss_mask`."""
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
