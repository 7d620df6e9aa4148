"""The trainer's state on disk: its `state_dict()` (train.py, the same form an elastic
replica serves a joining one) as a checkpoint folder (checkpoints/checkpoint.py), and back."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

import torch

from dflash.consumers.checkpoints.checkpoint import check_signal, read_checkpoint, resolve_checkpoint, write_checkpoint
from dflash.consumers.checkpoints.record import TrainedRecord
from dflash.consumers.parallel.dist import DistGroup
from dflash.protocol.training_signal import Signal
from dflash.runtime.logs import get_logger

from .train_config import TrainState
from dflash.consumers.training.config import TrainConfig

log = get_logger()


class Trainer(Protocol):
    """What of train.py's `Trainer` a checkpoint reads and restores (this module needs nothing of the loop)."""

    cfg: TrainConfig
    state: TrainState
    dist: DistGroup
    device: torch.device
    signal: Signal
    run_config: dict | None
    drafter_json: dict

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


def _rng_state(device: torch.device) -> torch.Tensor:
    parts = [torch.get_rng_state()]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device))
    return torch.cat(parts)


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    n = torch.get_rng_state().numel()
    torch.set_rng_state(state[:n].clone())
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[n:].clone(), device)


def save(t: Trainer, root: Path) -> Path | None:
    """A checkpoint of the trainer's step (every rank takes part); the folder on rank 0, else None."""
    cfg, state, dist = t.cfg, t.state, t.dist
    rng = dist.all_gather(_rng_state(t.device))  # collective: every rank takes part
    path = None
    if dist.rank == 0:
        t0 = time.monotonic()
        sd = t.state_dict()
        c = sd["counters"]
        body = {"tokens": c["tokens"], "samples": c["samples"], "epoch": c["epoch"],
                "signal": sd["signal"], "world_size": dist.world_size, "config": t.run_config,
                "scheduler": {"lr": cfg.lr, "min_lr": cfg.min_lr, "warmup": cfg.warmup,
                              "total_steps": cfg.total_steps, "planned_samples": state.planned_samples,
                              "by": "steps" if cfg.total_steps else "samples" if state.planned_samples else
                              "constant"}}
        path = write_checkpoint(root, c["step"], sd["model"], sd["optimizer"], state=body, rng=rng,
                                drafter_config=t.drafter_json, keep=cfg.keep, record=sd["record"])
        state.last_checkpoint = path
        log.info("train.checkpoint", step=state.step, path=str(path), seconds=round(time.monotonic() - t0, 3))
    state.saved_step = state.step
    return path


def read(path: Path, device: torch.device) -> tuple[dict, list[torch.Tensor], dict]:
    """(a `state_dict()`, every saved rank's RNG state, state.json)."""
    weights, optimizer, rng, saved = read_checkpoint(path, device)
    record = TrainedRecord.load(path)
    if record is None:  # an older checkpoint: its weights hold samples nobody listed
        log.warning("train.record_missing", checkpoint=str(path))
        record = TrainedRecord(complete=False)
    sd = {"model": weights, "optimizer": optimizer, "signal": saved["signal"],
          "counters": {"step": saved["step"], "tokens": saved["tokens"], "samples": saved["samples"],
                       "epoch": saved.get("epoch", 0), "saved_step": saved["step"]},
          "record": record.to_state()}
    return sd, rng, saved


def resume(t: Trainer, runs_dir) -> None:
    """Take the state of the checkpoint `t.cfg.resume` names, as a new lineage."""
    cfg, state, dist = t.cfg, t.state, t.dist
    path = resolve_checkpoint(cfg.resume, runs_dir)
    sd, rng, saved = read(path, t.device)
    diffs = check_signal(sd["signal"], t.signal, force=cfg.force, where=str(path))
    if diffs:
        log.warning("train.signal_changed", checkpoint=str(path), differences=diffs)
    previous = state.record.lineage
    t.load_state_dict(sd)
    state.resumed_from = str(path)
    state.planned_samples = (saved.get("scheduler") or {}).get("planned_samples")
    state.record.fork(previous, state.step)
    if dist.rank < len(rng):
        _set_rng_state(rng[dist.rank], t.device)
    else:  # more ranks than when saved: a fresh, reproducible stream for the new rank
        torch.manual_seed(cfg.seed + 1 + dist.rank + 1000 * state.step)
        log.info("train.rng_reseeded", rank=dist.rank, saved_ranks=len(rng))
    log.info("train.resumed", checkpoint=str(path), step=state.step, tokens=state.tokens,
             record_samples=state.record.count(), record_complete=state.record.complete)
