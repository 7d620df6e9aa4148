"""The training signal: what a drafter is trained to do (docs/DESIGN.md "The contract between
roles"). A consumer states it in its hello (`config.signal`, PROTOCOL.md 4.1: the broker
reads the target identity in it), every checkpoint records it, and ranks, heals and resumes
compare it: it never changes silently. Packing settings are not part of it.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields

from .errors import DFlashError


class SignalMismatch(DFlashError):
    """Two training signals differ where they must not (a resume, another rank, a heal): going
    on would silently change what the drafter is trained to do."""


@dataclass(frozen=True)
class Signal:
    """The training signal (docs/DESIGN.md "The contract between roles"): never changed silently."""

    anchors: int
    block_size: int
    target_layers: tuple[int, ...]
    gamma: float
    draft_layers: int
    mask_token_id: int
    target: dict  # the target's identity (runtime/target_heads.py identity_of; target_id.py compares)
    # Why this MASK row (consumers/drafter/mask_token.py MaskChoice.as_dict): recorded, not compared (the ID is)
    mask_choice: dict | None = None
    # --distill-weight: the share of the target's soft labels in the loss (0: hard labels only)
    distill: float = 0.0
    # --anchor-every: one anchor per this many trainable positions (1: every one, as before it existed)
    anchor_every: int = 1
    # --loss: "ce", the position-decayed cross-entropy (gamma), or "dpace" (docs/TRAINING.md "D-PACE")
    loss: str = "ce"
    # --dpace-alpha: D-PACE's confidence smoothing; None with loss "ce", which has none
    dpace_alpha: float | None = None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["target_layers"] = list(self.target_layers)
        return d


# Fields that explain the signal without being part of it: never a mismatch.
NOT_COMPARED = frozenset({"mask_choice"})


def signal_differences(saved: dict, current: Signal) -> list[str]:
    """'field: saved -> current' for every field that differs (a field a checkpoint
    predates counts as its default: a checkpoint saved before it existed trained with it)."""
    now = current.as_dict()
    defaults = {f.name: f.default for f in fields(Signal)}
    out = []
    for k in now:
        if k in NOT_COMPARED:
            continue
        was = saved.get(k, defaults.get(k)) if k in defaults and defaults[k] is not MISSING else saved.get(k)
        if was != now[k]:
            out.append(f"{k}: {was!r} -> {now[k]!r}")
    return out
