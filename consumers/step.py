"""One batch through the drafter: anchors, block inputs, forward, chunked loss.

Kept apart from the loop (train.py) so the tests and the loop run the very same code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import Batch
from .blocks import BlockLayout, anchor_seed, build_layout, sample_anchors
from .checkpoint import Signal
from .loss import LossStats, block_loss
from .model import DFlashDraft
from .target_heads import TargetHeads


def make_layout(batch: Batch, signal: Signal, seed: int, device: torch.device, backend: str) -> BlockLayout:
    """Draw each sequence's anchors (seeded by run seed, epoch and sample ID) and lay out the blocks."""
    anchors, start = [], 0
    mask = batch.loss_mask.bool().cpu()
    for sample, L in zip(batch.samples, batch.seq_lens):
        s = anchor_seed(seed, batch.epoch, sample)
        anchors.append(sample_anchors(mask[start : start + L], signal.block_size, signal.anchors, s))
        start += L
    return build_layout(batch.seq_lens, anchors, signal.block_size, device, backend)


def add_feature_noise(hidden: torch.Tensor, n_layers: int, sigma: float) -> torch.Tensor:
    """hidden + sigma * rms * N(0, 1), rms per token and per target layer.

    Relative to each layer's own scale: target layers differ in magnitude by orders, so
    one absolute sigma would drown shallow layers and not touch deep ones."""
    if sigma <= 0:
        return hidden
    T = hidden.shape[0]
    x = hidden.view(T, n_layers, -1)  # [T, n, D]
    rms = x.float().pow(2).mean(-1, keepdim=True).sqrt()  # [T, n, 1]
    noisy = x + (torch.randn(x.shape, device=x.device) * (sigma * rms)).to(x.dtype)
    return noisy.view(T, -1)


def draft_states(
    model: DFlashDraft, heads: TargetHeads, batch: Batch, layout: BlockLayout, signal: Signal, noise: float = 0.0
) -> torch.Tensor:
    """The drafter's final-normed states for every block position, [Q, D]."""
    device = heads.embed.device
    ids = batch.input_ids.to(device)
    block_ids = layout.block_input_ids(ids, signal.mask_token_id)  # [Q]: anchor, MASK, ...
    x = F.embedding(block_ids, heads.embed)  # [Q, D], frozen target embedding
    features = batch.hidden.to(device=device, dtype=heads.embed.dtype, non_blocking=True)  # [T, n*D]
    features = add_feature_noise(features, len(signal.target_layers), noise)
    return model(features, x, layout)


def batch_loss(
    model: DFlashDraft,
    heads: TargetHeads,
    batch: Batch,
    signal: Signal,
    *,
    seed: int,
    backend: str = "sdpa",
    noise: float = 0.0,
    loss_chunk: int = 2048,
) -> tuple[torch.Tensor | None, LossStats]:
    """(sum of weighted CE over the batch's block positions, stats). None for the loss
    when the batch has no anchor (all prompts, or sequences shorter than a block)."""
    device = heads.embed.device
    layout = make_layout(batch, signal, seed, device, backend)
    if layout.num_queries == 0:
        return None, LossStats(pos_correct=[0] * (signal.block_size - 1), pos_valid=[0] * (signal.block_size - 1))
    h = draft_states(model, heads, batch, layout, signal, noise)  # [Q, D]
    labels, valid = layout.labels(batch.input_ids.to(device), batch.loss_mask.to(device))
    return block_loss(h, heads.lm_head, labels, valid, signal.block_size, signal.gamma, loss_chunk)
