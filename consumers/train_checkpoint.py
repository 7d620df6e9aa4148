"""The training loop's checkpoints: resume its state from one, and save one.

The file format is checkpoint.py's; this module decides what of the loop's state goes in
and comes back out (counters, the record, every rank's RNG state).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflash.protocol.logs import get_logger

from .checkpoint import Signal, check_signal, load_checkpoint, resolve_checkpoint, save_checkpoint
from .dist import Dist
from .record import TrainedRecord

if TYPE_CHECKING:
    from .train_config import Hooks, TrainConfig, TrainState

log = get_logger()


def _rng_state(device: torch.device) -> torch.Tensor:
    """This rank's RNG states as one uint8 tensor (same size on every rank)."""
    parts = [torch.get_rng_state()]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device))
    return torch.cat(parts)


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    n = torch.get_rng_state().numel()
    torch.set_rng_state(state[:n].clone())
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[n:].clone(), device)


def resume(cfg: TrainConfig, signal: Signal, model, optimizer, state: TrainState, dist: Dist, runs_dir) -> None:
    path = resolve_checkpoint(cfg.resume, runs_dir)
    saved, rng = load_checkpoint(path, model, optimizer)
    diffs = check_signal(saved["signal"], signal, force=cfg.force, where=str(path))
    if diffs:
        log.warning("train.signal_changed", checkpoint=str(path), differences=diffs)
    state.step, state.tokens, state.samples = saved["step"], saved["tokens"], saved["samples"]
    state.saved_step = state.step
    state.epoch, state.resumed_from = saved.get("epoch", 0), str(path)
    state.planned_samples = (saved.get("scheduler") or {}).get("planned_samples")
    record = TrainedRecord.load(path)
    if record is None:  # an older checkpoint: its weights hold samples nobody listed
        log.warning("train.record_missing", checkpoint=str(path))
        record = TrainedRecord(complete=False)
    record.fork(state.record.lineage, state.step)  # these weights go on as a new lineage (record.py)
    state.record = record
    device = next(model.parameters()).device
    if dist.rank < len(rng):
        _set_rng_state(rng[dist.rank], device)
    else:  # more ranks than when saved: a fresh, reproducible stream for the new rank
        torch.manual_seed(cfg.seed + 1 + dist.rank + 1000 * state.step)
        log.info("train.rng_reseeded", rank=dist.rank, saved_ranks=len(rng))
    log.info("train.resumed", checkpoint=str(path), step=state.step, tokens=state.tokens,
             record_samples=state.record.count(), record_complete=state.record.complete)


def save(cfg: TrainConfig, signal: Signal, model, optimizer, state: TrainState, dist: Dist, root: Path,
         drafter_json, hooks: Hooks, run_config) -> None:
    """A checkpoint of `state.step` (rank 0 writes it, every rank takes part)."""
    device = next(model.parameters()).device
    rng = dist.all_gather(_rng_state(device))  # collective: every rank takes part
    if dist.rank == 0:
        t0 = time.monotonic()
        body = {"tokens": state.tokens, "samples": state.samples, "epoch": state.epoch,
                "signal": signal.as_dict(), "world_size": dist.world_size, "config": run_config,
                "scheduler": {"lr": cfg.lr, "min_lr": cfg.min_lr, "warmup": cfg.warmup,
                              "total_steps": cfg.total_steps, "planned_samples": state.planned_samples,
                              "by": "steps" if cfg.total_steps else "samples" if state.planned_samples else
                              "constant"}}
        path = save_checkpoint(root, state.step, model, optimizer, state=body, rng=rng,
                               drafter_config=drafter_json, keep=cfg.keep, record=state.record)
        state.last_checkpoint = path
        log.info("train.checkpoint", step=state.step, path=str(path), seconds=round(time.monotonic() - t0, 3))
        if hooks.on_checkpoint is not None:
            hooks.on_checkpoint(state.step, path)
    state.saved_step = state.step
    dist.barrier()  # nobody runs ahead of a checkpoint that may still fail
