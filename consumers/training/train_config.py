"""What a training run is given and gives back: its config, hooks and state, and the
values that follow from the config (the training signal, the lr and noise schedules).
The config's fields are config.py's; the loop itself is train.py."""

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
from dflash.consumers.drafter.model import init_layer_ids
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
    progress: Callable[[], dict] | None = None  # the broker's sample counts: epoch fraction and ETA
    plan: Callable[[], int | None] | None = None  # samples the run plans to train: the schedules' length
    budget_progress: Callable[[], float | None] | None = None  # --time-budget: share of training time gone
    stream_samples: int | None = None  # a local stream's size: the plan when nothing else gives one
    stop: threading.Event | None = None
    leave: Callable[[], bool] | None = None  # the stop is this process's alone: elastic, it leaves the group
    after_step: Callable[[int, torch.nn.Module], None] | None = None  # every rank, e.g. evaluation
    # every rank, before a step's forward: live evaluation on a batch the weights have not trained on
    before_step: Callable[[int, torch.nn.Module, Batch | None, TrainedRecord, int], None] | None = None
    stats: dict | None = None  # heartbeat keys (PROTOCOL.md 4.2), updated in place for an I/O thread
    on_lineage: Callable[[TrainedRecord], None] | None = None  # the record the weights now have (start, heals)
    resume_point: Callable[[], str | None] | None = None  # the broker's newest commit, when no replica heals us
    on_metrics: Callable[[int, dict], None] | None = None  # rank 0: each train.step line, for the metric sinks


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
    model: torch.nn.Module | None = field(default=None, repr=False)
    record: TrainedRecord = field(default_factory=TrainedRecord, repr=False)


# ---------------------------------------------------------------- setup


def resolve_signal(cfg: TrainConfig, heads: TargetHeads) -> Signal:
    """Fill the defaults that depend on the target. Raises ValueError on bad values."""
    spec = heads.spec
    layers = tuple(cfg.target_layers or default_layer_ids(spec.num_hidden_layers))  # the producers' rule
    if any(not 0 <= i < spec.num_hidden_layers - 1 for i in layers):
        # the last layer is the LM head's input, never a feature (SGLang #32204)
        raise ValueError(f"target layers {list(layers)} must lie in 0..{spec.num_hidden_layers - 2}")
    mask = mask_choice(heads, cfg.mask_token_id)  # logged once per target (train.mask_token)
    if cfg.block_size < 2 or cfg.anchors < 1 or cfg.anchor_every < 1 or cfg.draft_layers < 1:
        raise ValueError("block size must be >= 2, anchors, anchor spacing and draft layers >= 1")
    if cfg.loss not in LOSSES:
        raise ValueError(f"--loss {cfg.loss!r} is none of {', '.join(LOSSES)}")
    init_layer_ids(cfg.draft_init, cfg.draft_layers, spec.num_hidden_layers)  # fails here, before anything connects
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
    """How long the lr and noise schedules are: by samples, steps, time, or constant."""

    by: str  # samples | steps | time (--time-budget: progress is the broker's, start_p) | constant
    length: int | None  # samples or steps; None for constant
    source: str  # --total-steps | --total-samples | broker | checkpoint | stream | none
    start: int = 0  # a moved plan goes on from progress `start_p` at `start` samples
    start_p: float = 0.0

    def as_dict(self) -> dict:
        return {"by": self.by, "length": self.length, "source": self.source, "from_samples": self.start,
                "from_progress": round(self.start_p, 6)}

    def moved_to(self, new: "Plan", samples: int) -> "Plan":
        """`new` continuing this plan at `samples`: progress is kept, so the lr stays continuous."""
        return replace(new, start=samples, start_p=progress(self, 0, samples) or 0.0)


def choose_plan(cfg: TrainConfig, *, broker: int | None = None, checkpoint: int | None = None,
                stream: int | None = None, time: float | None = None, dataset: int | None = None) -> Plan:
    """The first known of --total-steps, --total-samples, the broker's time budget or planned
    samples, the checkpoint's plan, the stream's size; else a constant lr (warned)."""
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
    """Where a run is on its plan, 0..1 (None: constant)."""
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
    """Linear warmup, then cosine from lr to min_lr at p = 1; lr when nothing is planned."""
    if p is None:
        return cfg.lr
    if cfg.warmup > 0 and p < cfg.warmup:
        return cfg.lr * p / cfg.warmup
    q = min(1.0, (p - cfg.warmup) / (1.0 - cfg.warmup)) if cfg.warmup < 1 else 1.0
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * q)) * (cfg.lr - cfg.min_lr)


def lr_at(step: int, cfg: TrainConfig, samples: int = 0, plan: Plan | None = None) -> float:
    """The lr of step `step`, which brings the run to `samples` (the last planned is at min_lr)."""
    plan = plan or choose_plan(cfg)
    if plan.by != "steps":
        return lr_shape(progress(plan, step, samples), cfg)
    warm = max(1, math.ceil(cfg.warmup * plan.length))
    if step <= warm:
        return cfg.lr * step / warm
    p = min(1.0, (step - warm) / max(1, plan.length - warm))
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * p)) * (cfg.lr - cfg.min_lr)


def noise_at(step: int, cfg: TrainConfig, samples: int = 0, plan: Plan | None = None) -> float:
    """Feature noise of step `step`, decayed over the lr's plan from the samples before the step."""
    if cfg.feature_noise <= 0:
        return 0.0
    plan = plan or choose_plan(cfg)
    p = progress(plan, step, samples)
    if cfg.noise_schedule == "constant" or p is None:
        return cfg.feature_noise
    f = 1.0 - p if cfg.noise_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return cfg.feature_noise * f
