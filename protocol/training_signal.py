"""The training signal: what a drafter is trained to do (docs/DESIGN.md "The contract between roles").
Hellos state it, checkpoints record it, ranks, heals and resumes compare it: it never changes silently.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields

from .errors import DFlashError


class SignalMismatch(DFlashError):
    """Two training signals differ where they must not (a resume, another rank, a heal)."""


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
    mask_choice: dict | None = None  # why this MASK row: recorded, not compared (the ID is)
    distill: float = 0.0  # --distill-weight
    anchor_every: int = 1  # --anchor-every (1: every position, as before it existed)
    loss: str = "ce"  # --loss: "ce" or "dpace"
    dpace_alpha: float | None = None  # --dpace-alpha; None with loss "ce"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["target_layers"] = list(self.target_layers)
        return d


# Fields that explain the signal without being part of it: never a mismatch.
NOT_COMPARED = frozenset({"mask_choice"})


def signal_differences(saved: dict, current: Signal) -> list[str]:
    """'field: saved -> current' for every field that differs (a field a checkpoint predates counts as its default)."""
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
