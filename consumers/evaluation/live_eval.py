"""Live evaluation during training (`dflash-consume --eval-every N`), logged as `eval.*`
events and carried to the broker in the consumer's heartbeat (`stats.eval`), so
`dflash-status` shows it.

Every N steps rank 0 measures simulated acceptance (tau = streak + 1) on the batch the next
step is about to train, unseen by these weights, so nothing is held back from training; and,
with `--eval-prompts`, real tau (real_tau.py)."""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from dflash.consumers.checkpoints.record import TrainedRecord
from dflash.consumers.drafter.loss import empty_stats
from dflash.protocol.batch import Batch
from dflash.consumers.training.batch import check_fit
from dflash.consumers.training.step import batch_loss
from dflash.protocol.training_signal import Signal
from dflash.runtime.logs import get_logger
from dflash.runtime.target_heads import TargetHeads

from .real_tau import RealTauSet

log = get_logger()

EVAL_SEED = 0x5EED  # anchors of held-out batches: fixed, unlike training's per-epoch draw


@torch.no_grad()
def simulated_acceptance(model: nn.Module, heads: TargetHeads, batches: list[Batch], signal: Signal) -> dict:
    """loss, acc, streak, tau and per-position accuracy of `model` over `batches`."""
    device = heads.embed.device
    bf16 = device.type == "cuda" and heads.embed.dtype == torch.bfloat16  # as training runs it
    total = empty_stats(signal.block_size)
    was_training = model.training
    model.eval()
    try:
        for b in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                _, s = batch_loss(model, heads, b, signal, seed=EVAL_SEED)
            total.add(s)
    finally:
        model.train(was_training)
    streak = total.streak / total.blocks if total.blocks else 0.0
    return {
        "loss": round(total.loss_sum / total.weight, 5) if total.weight else None,
        "acc": round(total.correct / total.valid, 5) if total.valid else None,
        "streak": round(streak, 4), "tau": round(streak + 1, 4), "blocks": total.blocks,
        "acc_by_position": [round(c / v, 4) if v else None for c, v in zip(total.pos_correct, total.pos_valid)],
    }


def eval_hook(heads: TargetHeads, signal: Signal, held_out: list[Batch], every: int,
              rank: int = 0) -> Callable[[int, nn.Module], None]:
    """A `Hooks.after_step` logging `eval.step` every `every` steps on fixed held-out batches (rank 0)."""
    for b in held_out:
        check_fit(b, list(signal.target_layers), heads.spec.hidden_size)

    def after_step(step: int, model: nn.Module) -> None:
        if rank != 0 or every <= 0 or step % every:
            return
        t0 = time.monotonic()
        figures = simulated_acceptance(model, heads, held_out, signal)
        log.info("eval.step", step=step, batches=len(held_out), seconds=round(time.monotonic() - t0, 3), **figures)

    return after_step


class LiveEval:
    """`Hooks.before_step` of `--eval-every N`; each result is a new map in `stats["eval"]`, never
    changed after (the I/O thread copies the dict)."""

    def __init__(self, heads: TargetHeads, signal: Signal, every: int, *, rank: int = 0,
                 stats: dict | None = None, real: RealTauSet | None = None):
        if every < 1:
            raise ValueError(f"eval every {every} steps: must be >= 1")
        self.heads, self.signal, self.every, self.rank = heads, signal, every, rank
        self.stats, self.real = stats, real
        self.due = every  # the weights' step the next evaluation is for (or the first after it)
        self.last_end: float | None = None  # when the previous evaluation ended (overhead share)
        self.last_step = 0
        if real is not None:
            real.check_drafter(list(signal.target_layers), heads.spec.hidden_size)
            log.info("eval.start", every=every, prompts=len(real.prompts), max_new_tokens=real.max_new_tokens,
                     target_tokens=sum(len(b.tokens) for b in real.baselines), load_s=real.load_s)
        else:
            log.info("eval.start", every=every, prompts=0, max_new_tokens=None, target_tokens=0, load_s=0.0)

    def before_step(self, step: int, model: nn.Module, batch: Batch | None, record: TrainedRecord,
                    samples: int) -> None:
        """Evaluate the weights of `step` on the batch the next step trains (none: late, not lost)."""
        if self.rank != 0 or step < self.due or batch is None:
            return
        self.due = (step // self.every + 1) * self.every
        self.last_step = step
        t0 = time.monotonic()
        sim = simulated_acceptance(model, self.heads, [batch], self.signal)
        sim_s = time.monotonic() - t0
        unseen = sum(not any(record.holds(e, s) for e in record.epochs) for s in batch.samples)
        unseen_frac = round(unseen / max(1, len(batch.samples)), 4)
        log.info("eval.step", step=step, samples=samples, batch_id=batch.batch_id, epoch=batch.epoch,
                 sequences=len(batch.samples), unseen_frac=unseen_frac, seconds=round(sim_s, 3), **sim)
        real = self._real_tau(step, samples, model) if self.real is not None else None
        self._publish(step, samples, sim, unseen_frac, real, t0)

    def final(self, step: int, model: nn.Module, samples: int) -> None:
        """Real tau of the finished weights, if not measured at this step already."""
        if self.rank != 0 or self.real is None or step == 0 or step == self.last_step:
            return
        t0 = time.monotonic()
        real = self._real_tau(step, samples, model)
        self._publish(step, samples, None, None, real, t0)

    def _real_tau(self, step: int, samples: int, model: nn.Module) -> dict:
        t0 = time.monotonic()
        rep = self.real.evaluate(model, self.signal.block_size, self.signal.mask_token_id,
                                 list(self.signal.target_layers))
        figures = {k: rep[k] for k in ("tau", "tau_pooled", "tau_hist", "drafted", "accepted", "acceptance_rate",
                                       "prompts", "cycles", "new_tokens", "speedup", "mismatches", "tie_flips")}
        log.info("eval.tau", step=step, samples=samples, seconds=round(time.monotonic() - t0, 3), **figures)
        for r in rep["per_prompt"]:
            if not r["lossless"] and not r["tie_flip"]:
                log.error("eval.mismatch", step=step, prompt=r["prompt"], first_difference=r["first_difference"],
                          new_tokens=r["new_tokens"], top2_margin=r["top2_margin"], flip_margin=r["flip_margin"])
        return figures

    def _publish(self, step: int, samples: int, sim: dict | None, unseen_frac: float | None, real: dict | None,
                 t0: float) -> None:
        end = time.monotonic()
        seconds = end - t0
        overhead = seconds / (end - self.last_end) if self.last_end is not None else None
        self.last_end = end
        log.info("eval.cost", step=step, samples=samples, seconds=round(seconds, 3),
                 overhead_frac=round(overhead, 4) if overhead is not None else None)
        if self.stats is None:
            return
        self.stats["eval"] = {
            "step": step, "at": round(time.time(), 3), "seconds": round(seconds, 3),
            "overhead_frac": round(overhead, 4) if overhead is not None else None,
            "sim_tau": sim["tau"] if sim else None, "sim_acc": sim["acc"] if sim else None,
            "sim_loss": sim["loss"] if sim else None, "sim_blocks": sim["blocks"] if sim else 0,
            "unseen_frac": unseen_frac,
            "tau": real["tau"] if real else None, "tau_pooled": real["tau_pooled"] if real else None,
            "acceptance_rate": real["acceptance_rate"] if real else None,
            "speedup": real["speedup"] if real else None, "prompts": real["prompts"] if real else 0,
            "mismatches": len(real["mismatches"]) if real else 0,
            "tie_flips": len(real["tie_flips"]) if real else 0,
        }
