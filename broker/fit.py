"""Whether a batch fits the run's target: checked at intake, against the run's facts.

The codec checks a batch against itself (its tensors agree with its header and with each
other, PROTOCOL.md 4.4). This checks it against what the broker knows of the run's
target, as its producers stated it in their hellos (PROTOCOL.md 4.1): the layer IDs, the
hidden width (`len(layer_ids) x hidden_size`) and the vocabulary (every token ID in
`0..vocab_size-1`). A batch that does not fit makes every consumer that gets it fail, and
requeued it would fail the next one: it is refused before it is queued (intake.py).

Reads one tensor, `input_ids`, in place: its largest value as unsigned, so a negative ID
counts as out of range too (numpy, which transformers requires, over the frame's memory: no
copy, no torch). A fact nobody stated is not checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash.protocol.messages import Batch

from .facts import Facts


@dataclass(frozen=True)
class Misfit:
    """What is wrong with a batch: `fault` (layer_ids, hidden_width, token_ids) and a sentence."""

    fault: str
    reason: str


def misfit(facts: Facts, m: Batch) -> Misfit | None:
    """Why batch `m` does not fit a run with `facts`, or None."""
    layers = facts.layer_ids
    if layers is not None and m.layer_ids != layers:
        return Misfit("layer_ids", f"layer_ids {m.layer_ids} are not this run's {layers}")
    specs = tensor_specs(m)
    hidden_size = _count(facts.hidden_size)
    hidden = specs.get("hidden")
    if hidden_size and hidden is not None:
        width = hidden[1]["shape"][1]
        want = len(m.layer_ids) * hidden_size
        if width != want:
            return Misfit("hidden_width", f"hidden width {width} is not {len(m.layer_ids)} layers x this run's "
                          f"hidden_size {hidden_size} = {want}")
    vocab = _count(facts.vocab_size)
    ids = specs.get("input_ids")
    if vocab and ids is not None and ids[1]["shape"][0] > 0:
        frame = m.frames[1 + ids[0]]
        if largest_unsigned(frame) >= vocab:  # a negative ID reads as one past 2**31: caught too
            lo, hi = token_range(frame)
            return Misfit("token_ids", f"token IDs {lo}..{hi} lie outside this run's vocabulary 0..{vocab - 1}")
    return None


def tensor_specs(m: Batch) -> dict[str, tuple[int, dict]]:
    """Tensor name -> (its index among the tensor frames, its spec), as the codec passed
    them; empty for a batch built without its header (tests of the core)."""
    specs = m.raw.get("tensors") if isinstance(m.raw, dict) else None
    if not isinstance(specs, list) or len(m.frames) != len(specs) + 1:
        return {}
    return {s["name"]: (i, s) for i, s in enumerate(specs)}


def largest_unsigned(frame) -> int:
    """The largest int32 of a non-empty input_ids frame, read as unsigned: one pass (the
    check runs on every batch; a relay of small batches counts microseconds per batch)."""
    return int(np.frombuffer(getattr(frame, "buffer", frame), dtype="<u4").max())


def token_range(frame) -> tuple[int, int]:
    """(smallest, largest) int32 of a non-empty input_ids frame: only for the message."""
    ids = np.frombuffer(getattr(frame, "buffer", frame), dtype="<i4")
    return int(ids.min()), int(ids.max())


def _count(v) -> int | None:
    """A fact that is a positive int, else None (a fact is what a peer said it was)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
