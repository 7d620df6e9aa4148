"""What a training step logs: one `train.step` line per step with the field report's
content, and `train.position_acc` every N steps; every rank logs the same global sums."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from dflash.consumers.drafter.loss import LossStats
from dflash.runtime.logs import get_logger

from dflash.protocol.batch import Batch

log = get_logger()


@dataclass
class StepFigures:
    """One step's sums, this rank's or (after `summed`, one all-reduce) every rank's."""

    loss_sum: float = 0.0  # sum of weighted CE
    weight: float = 0.0  # sum of loss weights: the step's gradients are divided by it
    valid: float = 0.0
    correct: float = 0.0
    streak: float = 0.0
    blocks: float = 0.0
    tokens: float = 0.0
    samples: float = 0.0
    batches: float = 0.0
    pos_correct: list[float] = field(default_factory=list)  # per block position 1..B-1
    pos_valid: list[float] = field(default_factory=list)
    pending: torch.Tensor | None = None

    @classmethod
    def of(cls, batch: Batch | None, s: LossStats) -> "StepFigures":
        sizes = (batch.tokens, len(batch.samples), 1) if batch is not None else (0, 0, 0)
        return cls(s.loss_sum, s.weight, s.valid, s.correct, s.streak, s.blocks, *sizes,
                   list(s.pos_correct), list(s.pos_valid), s.pending)

    def as_list(self) -> list[float]:
        return [*(getattr(self, k) for k in _SCALARS), *self.pos_correct, *self.pos_valid]

    def read(self, norm: torch.Tensor | None = None) -> float:
        """Fold the device figures in, one read-back with `norm`; the norm (0.0 without one)."""
        stats = LossStats(self.loss_sum, self.weight, self.valid, self.correct, self.streak, self.blocks,
                          list(self.pos_correct), list(self.pos_valid), self.pending)
        extra = stats.read(*([] if norm is None else [norm]))
        self.loss_sum, self.weight, self.valid, self.correct, self.streak, self.blocks = (
            stats.loss_sum, stats.weight, stats.valid, stats.correct, stats.streak, stats.blocks)
        self.pos_correct, self.pos_valid, self.pending = stats.pos_correct, stats.pos_valid, None
        return extra[0] if extra else 0.0

    def summed(self, dist) -> "StepFigures":
        """Every rank's sums (a collective); one rank's come back as they are, unread."""
        if not dist.enabled:
            return self
        self.read()
        values = dist.all_sum(self.as_list())
        n, k = len(_SCALARS), len(self.pos_correct)
        return StepFigures(*values[:n], pos_correct=values[n : n + k], pos_valid=values[n + k :])


_SCALARS = ("loss_sum", "weight", "valid", "correct", "streak", "blocks", "tokens", "samples", "batches")


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

    def log_step(self, step: int, total: StepFigures, mine: StepFigures, *, lr: float, noise: float,
                 grad_norm: float, samples: int, tokens_seen: int, epoch: int, queue: dict, rank: int,
                 progress: dict | None = None, micro_batches: int = 1, ooms: int = 0, wait_s: float = 0.0,
                 wall_s: float = 0.0) -> dict:
        """Log one `train.step` line (global figures, plus this rank's share and OOMs); its fields."""
        f = total
        weight, valid, blocks = f.weight, f.valid, f.blocks
        self.tok += f.tokens
        self.bat += f.batches
        self.smp += f.samples
        self.hist.append((time.monotonic(), self.tok, self.bat, step, self.smp))
        (t0, k0, b0, s0, m0), (t1, k1, b1, s1, m1) = self.hist[0], self.hist[-1]
        dt = max(t1 - t0, 1e-9)
        epoch, eta = self._epoch_eta(step, samples, epoch, progress or {}, dt, s1 - s0, m1 - m0)
        line = dict(
            step=step, loss=round(f.loss_sum / weight, 5) if weight else None,
            acc=round(f.correct / valid, 4) if valid else None,
            streak=round(f.streak / blocks, 3) if blocks else None, lr=lr, noise=round(noise, 5),
            tokens_per_s=round((k1 - k0) / dt, 1), batches_per_s=round((b1 - b0) / dt, 3),
            queue=queue, epoch=epoch, eta_s=eta, rank=rank, grad_norm=round(grad_norm, 4),
            tokens=int(f.tokens), rank_tokens=int(mine.tokens), tokens_seen=tokens_seen,
            micro_batches=micro_batches, ooms=ooms, wait_s=round(wait_s, 4), wall_s=round(wall_s, 4),
        )
        log.info("train.step", **line)
        n = self.B - 1
        self.pos = [a + b for a, b in zip(self.pos, [*total.pos_correct, *total.pos_valid])]
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
        ETA = samples left of the plan (--time-budget's, else all epochs) / this job's sample
        rate. Else from --epoch-samples and --total-steps; else the batch's epoch and no ETA."""
        n, done = progress.get("n_samples"), progress.get("samples_done")
        total = progress.get("samples_planned") or progress.get("samples_total")
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
