"""What a training step logs: one `train.step` line per step with the field report's
content (the compact step line users of the earlier pipeline relied on), and `train.position_acc` every N steps.

Every figure is a sum over ranks (one all-reduce of a short vector per step), so every
rank logs the same global loss, accuracy and throughput.
"""

from __future__ import annotations

import time
from collections import deque

from dflash.protocol.logs import get_logger

from .batch import Batch
from .loss import LossStats

log = get_logger()

FIGURES = ("loss_sum", "weight", "valid", "correct", "streak", "blocks", "tokens", "samples", "batches")


def local_figures(batch: Batch | None, s: LossStats) -> list[float]:
    """This rank's sums in FIGURES order, then per-position correct and valid counts:
    everything a step logs, all-reduced in one collective."""
    sizes = [batch.tokens, len(batch.samples), 1] if batch is not None else [0, 0, 0]
    return [s.loss_sum, s.weight, s.valid, s.correct, s.streak, s.blocks, *sizes, *s.pos_correct, *s.pos_valid]


def named(values: list[float]) -> dict:
    return dict(zip(FIGURES, values))


class Meter:
    """Rates over a sliding window, and the per-position accuracy every N steps."""

    def __init__(self, block_size: int, total_steps: int | None, epoch_samples: int | None,
                 position_every: int, window: int = 20):
        self.B, self.total_steps, self.epoch_samples, self.position_every = (
            block_size, total_steps, epoch_samples, position_every)
        self.hist: deque = deque(maxlen=window + 1)  # (time, tokens, batches, step, samples)
        self.hist.append((time.monotonic(), 0, 0, 0, 0))
        self.tok = self.bat = self.smp = 0
        self.pos = [0.0] * (2 * (block_size - 1))

    def log_step(self, step: int, total: list[float], mine: list[float], *, lr: float, noise: float,
                 grad_norm: float, samples: int, tokens_seen: int, epoch: int, queue: dict, rank: int,
                 progress: dict | None = None, micro_batches: int = 1, ooms: int = 0) -> dict:
        """Log one `train.step` line (global figures; `rank_tokens` is this rank's share,
        `micro_batches` the parts this rank's batch ran in, more than 1 after an OOM, and
        `ooms` this rank's OOMs so far); return its fields."""
        f = named(total)
        weight, valid, blocks = f["weight"], f["valid"], f["blocks"]
        self.tok += f["tokens"]
        self.bat += f["batches"]
        self.smp += f["samples"]
        self.hist.append((time.monotonic(), self.tok, self.bat, step, self.smp))
        (t0, k0, b0, s0, m0), (t1, k1, b1, s1, m1) = self.hist[0], self.hist[-1]
        dt = max(t1 - t0, 1e-9)
        epoch, eta = self._epoch_eta(step, samples, epoch, progress or {}, dt, s1 - s0, m1 - m0)
        line = dict(
            step=step, loss=round(f["loss_sum"] / weight, 5) if weight else None,
            acc=round(f["correct"] / valid, 4) if valid else None,
            streak=round(f["streak"] / blocks, 3) if blocks else None, lr=lr, noise=round(noise, 5),
            tokens_per_s=round((k1 - k0) / dt, 1), batches_per_s=round((b1 - b0) / dt, 3),
            queue=queue, epoch=epoch, eta_s=eta, rank=rank, grad_norm=round(grad_norm, 4),
            tokens=int(f["tokens"]), rank_tokens=int(named(mine)["tokens"]), tokens_seen=tokens_seen,
            micro_batches=micro_batches, ooms=ooms,
        )
        log.info("train.step", **line)
        n = self.B - 1
        self.pos = [a + b for a, b in zip(self.pos, total[len(FIGURES) :])]
        if self.position_every > 0 and step % self.position_every == 0:
            acc = [round(c / v, 4) if v else None for c, v in zip(self.pos[:n], self.pos[n:])]
            log.info("train.position_acc", step=step, acc_by_position=acc, positions=list(range(1, self.B)))
            self.pos = [0.0] * (2 * n)
        return line

    def _epoch_eta(self, step: int, samples: int, epoch: float, progress: dict, dt: float, d_steps: int,
                   d_samples: float) -> tuple[float, int | None]:
        """Epoch fraction and ETA in seconds. From the broker's counts when it sent them
        (only it knows the run's size and what every consumer and earlier run trained):
        epoch = samples done / samples per epoch (1.25 = a quarter into the second epoch),
        ETA = samples left / this job's sample rate. Else from --epoch-samples and
        --total-steps; else the batch's epoch and no ETA."""
        n, total, done = progress.get("n_samples"), progress.get("samples_total"), progress.get("samples_done")
        if n and done is not None:
            epoch = round(done / n, 4)
        elif self.epoch_samples:
            epoch = round(samples / self.epoch_samples, 4)
        eta = None
        if total and done is not None:
            eta = round(max(0, total - done) * dt / d_samples) if d_samples > 0 else None
        elif self.total_steps:
            eta = round(max(0, self.total_steps - step) * dt / max(1, d_steps))
        return epoch, eta
