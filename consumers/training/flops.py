"""Model FLOPs of one drafter training step, for MFU (useful work only).

Counted, forward + backward, as matrix multiplications (2 FLOPs per multiply-add):
- trainable linear layers: 6 x params x rows (forward, input gradient, weight gradient);
  `fc` reads the frozen target features, which need no gradient: 4 x params x rows;
- the frozen LM head: 4 x D x V per scored position (forward, input gradient);
- attention: every block query against the keys it may see (context before its anchor
  plus its own block): 4 x head_dim x heads per key forward (scores and values), twice
  that backward.
Masked-out keys are not counted: an implementation that computes them (a dense mask)
does work that is not useful, and its MFU shows it. Norms, RoPE, softmax and the
optimizer are not counted (they are not matrix work).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.consumers.drafter.blocks import anchor_seed, sample_anchors
from dflash.consumers.drafter.model import DrafterConfig

from dflash.protocol.batch import Batch


@dataclass(frozen=True)
class StepShape:
    context_tokens: int  # T: packed context tokens
    queries: int  # Q: block positions (anchors x block size)
    scored: int  # block positions that carry a label (all but each block's anchor)
    attended_keys: int  # sum over queries of the keys each may see


def step_shape(batch: Batch, block_size: int, anchors: int, seed: int, anchor_every: int = 1) -> StepShape:
    """The shape of `batch`'s step, with the very anchors the training step draws."""
    mask, start, n_anchors, keys = batch.loss_mask.bool().cpu(), 0, 0, 0
    for sample, L in zip(batch.samples, batch.seq_lens):
        a = sample_anchors(mask[start : start + L], block_size, anchors, anchor_seed(seed, batch.epoch, sample),
                           anchor_every)
        n_anchors += a.numel()
        keys += int(a.sum()) * block_size + a.numel() * block_size * block_size
        start += L
    Q = n_anchors * block_size
    return StepShape(sum(batch.seq_lens), Q, n_anchors * (block_size - 1), keys)


def step_flops(cfg: DrafterConfig, vocab_size: int, shape: StepShape) -> int:
    D, hd, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    T, Q = shape.context_tokens, shape.queries
    fc = 4 * cfg.num_features * D * D * T
    per_layer = (
        6 * 2 * D * Hq * hd * Q  # q_proj, o_proj on block positions
        + 6 * 2 * D * Hkv * hd * (T + Q)  # k_proj, v_proj on context and block positions
        + 6 * 3 * D * cfg.intermediate_size * Q  # gate, up, down
        + 12 * hd * Hq * shape.attended_keys  # scores and values, forward and backward
    )
    head = 4 * D * vocab_size * shape.scored
    return fc + cfg.num_layers * per_layer + head

