"""A step whose loss or gradient norm is not finite is not applied, and the run stops.

Skipping would ack samples the weights never learned, or leave them unacked forever; so the
step is refused before its optimizer step, ack and checkpoint, and a resume redoes it. Every
rank sees the same sums, so every rank stops at the same step."""

from __future__ import annotations

import math

from dflash.protocol.errors import DFlashError
from dflash.runtime.logs import get_logger

log = get_logger()


class NonFiniteStep(DFlashError):
    """A step's loss or gradient norm is NaN or infinite: it was not applied."""


def check_step(step: int, loss_sum: float, grad_norm: float | None, batch_id: str | None, rank: int = 0) -> None:
    """Raise NonFiniteStep (logged `train.non_finite`) unless both figures are finite."""
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
