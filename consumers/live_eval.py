"""Live evaluation during training: simulated acceptance on held-out batches, logged as
`eval.step` events, through the training loop's existing `Hooks.after_step`.

Simulated acceptance is what training measures, on data the drafter never trains on: for
each anchor the block is drafted from the context before it, and the correct prefix of
the block (`streak`) is the number of drafts a greedy verifier would accept, so
tau = streak + 1 (DFLASH.md "Metrics"). The held-out anchors are drawn with a fixed seed,
so successive evaluations measure the same blocks and differ only by the weights.

Real tau needs the whole target, which a consumer does not load: dflash-eval on the
checkpoints gives it (docs/EVAL.md).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from dflash.protocol.logs import get_logger

from .batch import Batch
from .checkpoint import Signal
from .loss import empty_stats
from .step import batch_loss
from .target_heads import TargetHeads

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
    """A `Hooks.after_step` that logs `eval.step` every `every` steps (rank 0 only: the
    figures do not depend on the rank, and no collective is involved)."""
    for b in held_out:
        b.check(list(signal.target_layers), heads.spec.hidden_size)

    def after_step(step: int, model: nn.Module) -> None:
        if rank != 0 or every <= 0 or step % every:
            return
        t0 = time.monotonic()
        figures = simulated_acceptance(model, heads, held_out, signal)
        log.info("eval.step", step=step, batches=len(held_out), seconds=round(time.monotonic() - t0, 3), **figures)

    return after_step
