"""The DFlash loss, computed in chunks so [Q, vocab] logits never exist all at once.

A plain chunked loop would not help (autograd keeps every chunk's logits), so `ChunkedCE`
computes the gradient w.r.t. the drafter's output during the forward (the LM head is frozen)
and keeps only that [Q, D]. --loss: "ce" (the paper's fixed decay) or "dpace" (docs/TRAINING.md)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import fused


def default_gamma(block_size: int) -> float:
    """The paper's decay constants (7 for B=16, 5 for B=10, 4 for B=8), else the line 1 + 3B/8."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, 1.0 + 3.0 * block_size / 8.0)


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k = 0..B-1 (k = 0 never has loss; its weight is unused)."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1).clamp(min=0) / gamma)


def dpace_weights(q: torch.Tensor, valid: torch.Tensor, block_size: int, alpha: float) -> torch.Tensor:
    """D-PACE's weights (docs/TRAINING.md): per block, w_j = sum over valid m >= j of prod over
    valid i <= m of ((1 - alpha) q_i + alpha); a position without loss is a factor 1."""
    keep = valid.view(-1, block_size)
    s = torch.where(keep, (1.0 - alpha) * q.view(-1, block_size) + alpha, torch.ones_like(keep, dtype=q.dtype))
    c = torch.cumprod(s, dim=1) * keep  # the smoothed chance that the prefix up to m is accepted
    return (c.flip(1).cumsum(1).flip(1) * keep).view(-1)  # suffix sums: the credit position j gets


class ChunkedCE(torch.autograd.Function):
    """sum_i w_i * CE(h_i @ W^T, y_i) and argmax predictions in row chunks (with target states t:
    `distill_chunk`). w None (dpace): unit-weight losses and gradients are kept and weighted
    after the last chunk; the gradient is linear in each row's weight, so still one LM-head pass."""

    @staticmethod
    def forward(ctx, h, W, y, w, chunk: int, t=None, alpha: float = 0.0, reweight=None):
        if (w is None) == (reweight is None):
            raise ValueError("ChunkedCE takes either fixed weights w or a reweight function, not both")
        need_grad = ctx.needs_input_grad[0]
        grad_h = torch.zeros_like(h) if need_grad else None
        acc = torch.promote_types(h.dtype, torch.float32)  # at least fp32 for softmax sums
        row_loss = torch.empty(h.shape[0], dtype=acc, device=h.device)
        hard = row_loss if t is None else torch.empty_like(row_loss)  # each row's CE on its label
        preds = torch.empty(h.shape[0], dtype=torch.long, device=h.device)
        chunk_fn = fused.get("ce_chunk")
        for s in range(0, h.shape[0], chunk):
            e = min(s + chunk, h.shape[0])
            logits = h[s:e].to(W.dtype) @ W.T  # [c, V]: the only vocab-sized tensor (two with t)
            ws = None if w is None else w[s:e]
            if t is None:
                row_loss[s:e], preds[s:e], g = chunk_fn(logits, y[s:e], ws, need_grad, W.dtype)
            else:
                row_loss[s:e], hard[s:e], preds[s:e], g = distill_chunk(logits, t[s:e].to(W.dtype) @ W.T, y[s:e],
                                                                        ws, alpha, need_grad)
            if need_grad:
                grad_h[s:e] = (g.to(W.dtype) @ W).to(h.dtype)  # [c, D] (ce_chunk's g is in W's dtype: no copy)
        if reweight is not None:
            with torch.no_grad():
                w = reweight(hard.detach()).to(acc)
            if need_grad:
                grad_h.mul_(w[:, None].to(grad_h.dtype))
        loss = (w.to(acc) * row_loss).sum()
        ctx.save_for_backward(grad_h)
        ctx.mark_non_differentiable(preds)
        return loss, preds

    @staticmethod
    def backward(ctx, grad_loss, _grad_preds):
        (grad_h,) = ctx.saved_tensors
        return grad_h * grad_loss.to(grad_h.dtype), None, None, None, None, None, None, None


def distill_chunk(logits: torch.Tensor, target_logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None,
                  alpha: float, need_grad: bool):
    """One chunk of (1 - a) CE + a KL(p_target || p_draft), with its gradient: both terms' are
    softmax(z) minus a target, so it is softmax(z) - ((1 - a) onehot(y) + a p_target)."""
    acc = torch.promote_types(logits.dtype, torch.float32)  # at least fp32 for softmax sums
    z = logits.to(acc)
    logp = torch.log_softmax(z, dim=-1)  # [c, V]
    logq = torch.log_softmax(target_logits.to(acc), dim=-1)  # [c, V], the target's distribution
    q = logq.exp()
    hard = -logp.gather(1, y[:, None])[:, 0]
    kl = (q * (logq - logp)).sum(dim=-1)
    rows = (1.0 - alpha) * hard + alpha * kl
    g = None
    if need_grad:
        soft = alpha * q
        soft[torch.arange(y.shape[0], device=y.device), y] += 1.0 - alpha
        g = logp.exp() - soft
        if w is not None:
            g = w.to(acc)[:, None] * g
    return rows, hard, z.argmax(dim=-1), g


@dataclass
class LossStats:
    """Sums (not means) so that ranks and steps can be added before dividing; `pending` holds
    more on the device, unread (a read waits for the GPU)."""

    loss_sum: float = 0.0  # sum of weighted CE
    weight: float = 0.0  # the denominator of the mean: the weights' sum (ce), blocks with loss (dpace)
    valid: int = 0  # positions with loss
    correct: int = 0  # of those, argmax == label
    streak: float = 0.0  # sum over blocks of the correct-prefix length
    blocks: int = 0
    pos_correct: list | None = None  # per block position 1..B-1
    pos_valid: list | None = None
    pending: torch.Tensor | None = None

    def add(self, other: "LossStats") -> "LossStats":
        self.loss_sum += other.loss_sum
        self.weight += other.weight
        self.valid += other.valid
        self.correct += other.correct
        self.streak += other.streak
        self.blocks += other.blocks
        self.pos_correct = [a + b for a, b in zip(self.pos_correct, other.pos_correct)]
        self.pos_valid = [a + b for a, b in zip(self.pos_valid, other.pos_valid)]
        if other.pending is not None:
            self.pending = other.pending if self.pending is None else self.pending + other.pending
        return self

    def read(self, *extra: torch.Tensor) -> list[float]:
        """Fold `pending` in, one read-back together with `extra` (e.g. a gradient norm); their values."""
        if self.pending is None and not extra:
            return []
        parts = [] if self.pending is None else [self.pending]
        figs = torch.cat(parts + [e.detach().double().reshape(1) for e in extra]).tolist()
        if self.pending is None:
            return figs
        n = len(self.pos_correct)
        self.loss_sum += figs[0]
        self.weight += figs[1]
        self.valid += int(figs[2])
        self.correct += int(figs[3])
        self.streak += figs[4]
        self.blocks += int(figs[5])
        self.pos_correct = [a + int(x) for a, x in zip(self.pos_correct, figs[6:6 + n])]
        self.pos_valid = [a + int(x) for a, x in zip(self.pos_valid, figs[6 + n:6 + 2 * n])]
        self.pending = None
        return figs[6 + 2 * n:]


def known_figures(valid: torch.Tensor, block_size: int, gamma: float) -> LossStats:
    """The figures that follow from host `valid` alone, by `block_loss`'s arithmetic, so the sums agree."""
    B = block_size
    w = position_weights(B, gamma).repeat(valid.shape[0] // B) * valid
    vb = valid.view(-1, B)[:, 1:]
    figs = torch.cat([torch.stack([w.sum().double(), vb.sum().double(), vb.any(dim=1).sum().double()]),
                      vb.sum(dim=0).double()]).tolist()
    return LossStats(weight=figs[0], valid=int(figs[1]), blocks=int(figs[2]), pos_correct=[0] * (B - 1),
                     pos_valid=[int(x) for x in figs[3:]])


LOSSES = ("ce", "dpace")  # --loss: the decayed CE of the DFlash paper, or D-PACE (docs/TRAINING.md)


def block_loss(
    h: torch.Tensor,
    lm_head: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    gamma: float,
    chunk: int = 2048,
    soft: torch.Tensor | None = None,
    distill: float = 0.0,
    loss: str = "ce",
    dpace_alpha: float = 0.5,
    *,
    rows: torch.Tensor | None = None,
    known: LossStats | None = None,
    defer: bool = False,
) -> tuple[torch.Tensor, LossStats]:
    """(weighted CE summed over positions with loss, stats). dpace's weight is the blocks with
    loss, not the weights' sum, which would cancel their credit (docs/TRAINING.md). `rows` and
    `known` from the host spare read-backs. The caller divides by the global weight, which
    makes data parallel training exact."""
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r} is none of {', '.join(LOSSES)}")
    B = block_size
    # only positions with loss go through the LM head: the rest is vocab-sized work for weight 0
    if rows is None:
        rows = valid.nonzero()[:, 0]
    t = soft.index_select(0, rows) if distill > 0 else None
    if loss == "ce":
        w = position_weights(B, gamma, h.device).repeat(h.shape[0] // B) * valid  # [Q]
        loss_sum, scored = ChunkedCE.apply(h.index_select(0, rows), lm_head, labels.index_select(0, rows),
                                           w.index_select(0, rows), chunk, t, float(distill))
    else:
        def reweight(ce_rows: torch.Tensor) -> torch.Tensor:
            q = torch.ones(h.shape[0], dtype=ce_rows.dtype, device=h.device).index_copy_(0, rows, torch.exp(-ce_rows))
            return dpace_weights(q, valid, B, dpace_alpha).index_select(0, rows)

        loss_sum, scored = ChunkedCE.apply(h.index_select(0, rows), lm_head, labels.index_select(0, rows), None,
                                           chunk, t, float(distill), reweight)
    preds = torch.full_like(labels, -1).index_copy_(0, rows, scored)
    n = B - 1
    with torch.no_grad():
        ok = ((preds == labels) & valid).view(-1, B)[:, 1:]  # [n_blocks, B-1]
        vb = valid.view(-1, B)[:, 1:]
        # a block's correct prefix: as a draft, it ends at the first miss
        streak = ok.int().cumprod(dim=1).sum(dim=1)  # [n_blocks]
        has_loss = vb.any(dim=1)
        # one float64 vector, read back at once (each read drains the GPU); exact for counts
        if known is None:
            stats = LossStats(pos_correct=[0] * n, pos_valid=[0] * n)
            denominator = w.sum() if loss == "ce" else has_loss.sum()
            sums = torch.stack([loss_sum.detach().double(), denominator.double(), vb.sum().double(), ok.sum().double(),
                                (streak * has_loss).sum().double(), has_loss.sum().double()])
            per_pos = [ok.sum(dim=0).double(), vb.sum(dim=0).double()]
        else:  # the weight of "dpace" is the blocks with loss, known too
            stats = replace(known, pos_correct=list(known.pos_correct), pos_valid=list(known.pos_valid),
                            weight=known.weight if loss == "ce" else float(known.blocks))
            zero = torch.zeros((), dtype=torch.float64, device=h.device)
            sums = torch.stack([loss_sum.detach().double(), zero, zero, ok.sum().double(),
                                (streak * has_loss).sum().double(), zero])
            per_pos = [ok.sum(dim=0).double(), torch.zeros(n, dtype=torch.float64, device=h.device)]
        stats.pending = torch.cat([sums, *per_pos])
    if not defer or known is None:  # deferred only where the weight is known: the step divides by it
        stats.read()
    return loss_sum, stats


def empty_stats(block_size: int) -> LossStats:
    return LossStats(pos_correct=[0] * (block_size - 1), pos_valid=[0] * (block_size - 1))
