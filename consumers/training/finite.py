"""A step whose loss or gradient norm is not finite is not applied, and the run stops.

Why stop rather than skip: a NaN or inf comes from a corrupt batch (a producer's feature
row), a damaged checkpoint, or divergence. Skipping would either ack samples the weights
never learned (a silent loss) or leave them unacked forever; going on after divergence
trains nothing. So the step is refused before `optimizer.step()`, before its ack and before
any checkpoint: the weights, the record and the ledger all stay at the previous step, the
consumer exits non-zero naming the step and its batch, and a resume redoes the work.
Every rank sees the same summed loss and the same all-reduced gradient norm, so every
rank stops at the same step.
"""

from __future__ import annotations

import math

from dflash.protocol.errors import DFlashError
from dflash.runtime.logs import get_logger

log = get_logger()


class NonFiniteStep(DFlashError):
    """A step's loss or gradient norm is NaN or infinite: it was not applied."""


def check_step(step: int, loss_sum: float, grad_norm: float | None, batch_id: str | None, rank: int = 0) -> None:
    """Raise NonFiniteStep (after logging `train.non_finite`) unless both figures are finite.
    `grad_norm` None: not computed yet (the loss is checked alone)."""
    bad = [name for name, v in (("loss", loss_sum), ("grad_norm", grad_norm)) if v is not None and not math.isfinite(v)]
    if not bad:
        return
    log.error("train.non_finite", step=step, batch_id=batch_id, rank=rank, what=bad,
              loss_sum=None if not math.isfinite(loss_sum) else loss_sum,
              grad_norm=None if grad_norm is None or not math.isfinite(grad_norm) else grad_norm)
    raise NonFiniteStep(
        f"step {step}: {' and '.join(bad)} not finite (batch {batch_id or 'none on this rank'}); the step was "
        "not applied, acked or saved. Check that batch's features (a producer's bad rows) or the checkpoint "
        "resumed from; resume from the last checkpoint once the cause is fixed")
