"""What a training run is given and gives back: its config, hooks and state, and the
values that follow from the config (the training signal, the lr and noise schedules).

The config's fields, the options of dflash-consume, are config.py's; the loop itself is train.py.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from dflash.consumers.checkpoints.record import TrainedRecord
from dflash.consumers.drafter.loss import LOSSES, default_gamma
from dflash.consumers.drafter.mask_token import mask_choice
from dflash.protocol.training_signal import Signal
from dflash.runtime.target_heads import TargetHeads
from dflash.runtime.targets import default_layer_ids

from dflash.protocol.batch import Batch
from .config import TrainConfig


@dataclass
class Hooks:
    on_step: Callable[[int, list[str]], None] | None = None
    on_checkpoint: Callable[[int, Path], None] | None = None
    queue: Callable[[], dict] | None = None
    # The run's sample counts, {samples_total, samples_done, n_samples} (the broker's
    # heartbeat): the logged epoch fraction and ETA come from them when present.
    progress: Callable[[], dict] | None = None
    # The samples the run plans to train (the broker's epochs x samples, less skipped),
    # or None while unknown: the lr and noise schedules' length (docs/TRAINING.md)
    plan: Callable[[], int | None] | None = None
    # --time-budget: the share of the run's training time gone (the broker's heartbeat), or
    # None: the lr and noise schedules' progress instead of samples over a plan
    budget_progress: Callable[[], float | None] | None = None
    # Samples a local stream holds (synthetic): the plan, counted from where this process
    # starts, when neither --total-samples, the broker nor a resumed checkpoint gives one
    stream_samples: int | None = None
    stop: threading.Event | None = None
    # Whether the stop asked is this process's alone (a signal to it, not the broker's stop):
    # in an elastic group such a rank leaves and the others go on (train.py `agree`)
    leave: Callable[[], bool] | None = None
    after_step: Callable[[int, torch.nn.Module], None] | None = None  # every rank, e.g. evaluation
    # Every rank, before a step's forward: (optimizer steps so far, model, this rank's batch
    # or None, the record, samples trained so far by all ranks); live evaluation on a batch
    # the weights have not trained on yet.
    before_step: Callable[[int, torch.nn.Module, Batch | None, TrainedRecord, int], None] | None = None
    # Updated in place after every step with the consumer's heartbeat keys (PROTOCOL.md
    # 4.2: step, loss, acc, streak, tokens_per_s, batches_per_s, state), for an I/O thread
    # to read.
    stats: dict | None = None
    # The record whose lineage the weights now have (record.py), after the start and after
    # every heal: acks and commits name it; a new one is announced to the broker.
    on_lineage: Callable[[TrainedRecord], None] | None = None
    # A checkpoint newer than TrainConfig.resume to start from when no running replica
    # heals us (the broker's newest commit, which may be newer than its welcome said).
    resume_point: Callable[[], str | None] | None = None
    # Rank 0, after each step's train.step line: (step, that line's fields), for the
    # metric sinks (--tensorboard, runtime/sinks.py)
    on_metrics: Callable[[int, dict], None] | None = None


@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0  # target tokens trained on, all ranks
    samples: int = 0
    epoch: int = 0
    planned_samples: int | None = None  # the schedule's length the last step used (checkpointed)
    resumed_from: str | None = None
    saved_step: int = 0  # the newest checkpoint's step (every rank agrees: it decides a collective)
    end_reason: str = ""
    last_checkpoint: Path | None = None
    model: torch.nn.Module | None = field(default=None, repr=False)  # the trained drafter
    # (epoch, sample) -> times trained, all ranks, cumulative over resumes (record.py)
    record: TrainedRecord = field(default_factory=TrainedRecord, repr=False)


# ---------------------------------------------------------------- setup


def resolve_signal(cfg: TrainConfig, heads: TargetHeads) -> Signal:
    """Fill the defaults that depend on the target. Raises ValueError on bad values."""
    spec = heads.spec
    layers = tuple(cfg.target_layers or default_layer_ids(spec.num_hidden_layers))  # the producers' rule
    if any(not 0 <= i < spec.num_hidden_layers - 1 for i in layers):
        # The last layer is excluded on purpose (SGLang #32204): it is the LM head's input.
        raise ValueError(f"target layers {list(layers)} must lie in 0..{spec.num_hidden_layers - 2}")
    mask = mask_choice(heads, cfg.mask_token_id)  # logged once per target (train.mask_token)
    if cfg.block_size < 2 or cfg.anchors < 1 or cfg.anchor_every < 1 or cfg.draft_layers < 1:
        raise ValueError("block size must be >= 2, anchors, anchor spacing and draft layers >= 1")
    if cfg.loss not in LOSSES:
        raise ValueError(f"--loss {cfg.loss!r} is none of {', '.join(LOSSES)}")
    alpha = None
    if cfg.loss == "dpace":
        # D-PACE has no fixed decay: a --gamma would be recorded in the signal and silently unused
        if cfg.gamma is not None:
            raise ValueError("--gamma sets the decay of --loss ce; --loss dpace has no fixed decay")
        alpha = 0.5 if cfg.dpace_alpha is None else float(cfg.dpace_alpha)
        if not 0.0 < alpha <= 1.0:  # 0: the products vanish with the first unsure position
            raise ValueError(f"--dpace-alpha {alpha} must lie in (0, 1]")
    elif cfg.dpace_alpha is not None:
        raise ValueError("--dpace-alpha is D-PACE's smoothing: give --loss dpace too")
    gamma = float(cfg.gamma) if cfg.gamma is not None else default_gamma(cfg.block_size)
    if not 0.0 <= cfg.distill_weight <= 1.0:
        raise ValueError(f"--distill-weight {cfg.distill_weight} must lie in 0..1")
    return Signal(cfg.anchors, cfg.block_size, layers, gamma, cfg.draft_layers, mask.token_id, heads.identity,
                  mask_choice=mask.as_dict(), distill=float(cfg.distill_weight), anchor_every=cfg.anchor_every,
                  loss=cfg.loss, dpace_alpha=alpha)


@dataclass(frozen=True)
class Plan:
    """How long the lr and noise schedules are: `by` samples trained (the default),
    optimizer steps (--total-steps), or `constant` (nothing planned)."""

    by: str  # samples | steps | time (--time-budget: progress is the broker's, start_p) | constant
    length: int | None  # samples or steps; None for constant
    source: str  # --total-steps | --total-samples | broker | checkpoint | stream | none
    # A plan that moved (the broker re-planned, --time-budget) goes on from where the old one
    # was: progress `start_p` at `start` samples, reaching 1 at `length` (see `progress`)
    start: int = 0
    start_p: float = 0.0

    def as_dict(self) -> dict:
        return {"by": self.by, "length": self.length, "source": self.source, "from_samples": self.start,
                "from_progress": round(self.start_p, 6)}

    def moved_to(self, new: "Plan", samples: int) -> "Plan":
        """`new`, the same kind of plan with another length, continuing this one at `samples`
        trained: the progress there is kept and what is left of it is spread over the samples
        left, so the lr stays continuous, and keeps falling once annealing began."""
        return replace(new, start=samples, start_p=progress(self, 0, samples) or 0.0)


def choose_plan(cfg: TrainConfig, *, broker: int | None = None, checkpoint: int | None = None,
                stream: int | None = None, time: float | None = None, dataset: int | None = None) -> Plan:
    """The first that is known: --total-steps, --total-samples, the broker's time budget
    (`time`: the share of its training time gone; `dataset`: its epochs x samples, whose end
    ends the schedule too if it comes first), the broker's planned samples, the
    resumed checkpoint's plan (a resume continues its curve), the local stream's size; else
    a constant lr (logged as a warning by the loop)."""
    if cfg.total_steps:
        return Plan("steps", cfg.total_steps, "--total-steps")
    if not cfg.total_samples and time is not None:
        return Plan("time", dataset or None, "--time-budget", start_p=min(1.0, max(0.0, float(time))))
    for length, source in ((cfg.total_samples, "--total-samples"), (broker, "broker"),
                           (checkpoint, "checkpoint"), (stream, "stream")):
        if length:
            return Plan("samples", int(length), source)
    return Plan("constant", None, "none")


def progress(plan: Plan, step: int, samples: int) -> float | None:
    """Where a run is on its plan, 0..1 (None: constant): `step` optimizer steps or
    `samples` trained over the plan's length; a time plan's is the broker's."""
    if plan.by == "time":  # the broker's clock, or the dataset's end if it comes first (exact here)
        return min(1.0, max(plan.start_p, samples / plan.length if plan.length else 0.0))
    if plan.by == "constant" or not plan.length:
        return None
    if plan.by == "samples" and plan.start:
        if plan.length <= plan.start:
            return 1.0
        done = max(0, samples - plan.start) / (plan.length - plan.start)
        return min(1.0, plan.start_p + done * (1.0 - plan.start_p))
    return min(1.0, max(0, step if plan.by == "steps" else samples) / plan.length)


def lr_shape(p: float | None, cfg: TrainConfig) -> float:
    """Linear warmup over the first `warmup` of the plan, then cosine from lr to min_lr
    at p = 1; lr when nothing is planned."""
    if p is None:
        return cfg.lr
    if cfg.warmup > 0 and p < cfg.warmup:
        return cfg.lr * p / cfg.warmup
    q = min(1.0, (p - cfg.warmup) / (1.0 - cfg.warmup)) if cfg.warmup < 1 else 1.0
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * q)) * (cfg.lr - cfg.min_lr)


def lr_at(step: int, cfg: TrainConfig, samples: int = 0, plan: Plan | None = None) -> float:
    """The lr of optimizer step `step` (1-based) which brings the run to `samples` trained
    (its own included: the last planned sample is trained at min_lr). By steps
    (--total-steps): warmup over ceil(warmup * total_steps) steps, then cosine."""
    plan = plan or choose_plan(cfg)
    if plan.by != "steps":
        return lr_shape(progress(plan, step, samples), cfg)
    warm = max(1, math.ceil(cfg.warmup * plan.length))
    if step <= warm:
        return cfg.lr * step / warm
    p = min(1.0, (step - warm) / max(1, plan.length - warm))
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * p)) * (cfg.lr - cfg.min_lr)


def noise_at(step: int, cfg: TrainConfig, samples: int = 0, plan: Plan | None = None) -> float:
    """Feature noise of step `step`, decayed over the same plan as the lr; `samples` are
    those trained before the step (noise is drawn before its batch is trained)."""
    if cfg.feature_noise <= 0:
        return 0.0
    plan = plan or choose_plan(cfg)
    p = progress(plan, step, samples)
    if cfg.noise_schedule == "constant" or p is None:
        return cfg.feature_noise
    f = 1.0 - p if cfg.noise_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return cfg.feature_noise * f
