"""Whether a batch fits the run's target (layer IDs, hidden width, vocabulary): checked at intake,
as a misfit batch would fail every consumer it is requeued to. A fact nobody stated is not checked.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.protocol.batch import Batch

from .facts import Facts
from .inbound import Arrival


@dataclass(frozen=True)
class Misfit:
    """What is wrong with a batch: `fault` (layer_ids, hidden_width, token_ids) and a sentence."""

    fault: str
    reason: str


def misfit(facts: Facts, a: Arrival) -> Misfit | None:
    """Why the batch of arrival `a` does not fit a run with `facts`, or None."""
    m, layers = a.batch, facts.layer_ids
    if layers is not None and m.layer_ids != layers:
        return Misfit("layer_ids", f"layer_ids {m.layer_ids} are not this run's {layers}")
    hidden_size = _count(facts.hidden_size)
    hidden = tensor_specs(m).get("hidden")
    if hidden_size and hidden is not None:
        width = hidden["shape"][1]
        want = len(m.layer_ids) * hidden_size
        if width != want:
            return Misfit("hidden_width", f"hidden width {width} is not {len(m.layer_ids)} layers x this run's "
                          f"hidden_size {hidden_size} = {want}")
    vocab, ids = _count(facts.vocab_size), a.token_ids
    if vocab and ids is not None and (ids.lo < 0 or ids.hi >= vocab):
        return Misfit("token_ids", f"token IDs {ids.lo}..{ids.hi} lie outside this run's vocabulary 0..{vocab - 1}")
    return None


def tensor_specs(m: Batch) -> dict[str, dict]:
    """Tensor name -> its header spec; empty for a batch built without its header."""
    specs = m.raw.get("tensors") if isinstance(m.raw, dict) else None
    if not isinstance(specs, list):
        return {}
    return {s["name"]: s for s in specs}


def _count(v) -> int | None:
    """A fact that is a positive int, else None (a fact is what a peer said it was)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
