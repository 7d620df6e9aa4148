"""One batch through the drafter: anchors, block inputs, forward, chunked loss.

Kept apart from the loop (train.py) so the tests and the loop run the very same code.
"""

from __future__ import annotations

import hashlib

import torch

from dflash.protocol.training_signal import Signal
from dflash.runtime.target_heads import TargetHeads

from .batch import Batch
from .blocks import BlockLayout, anchor_seed, build_layout, sample_anchors
from .loss import LossStats, block_loss
from .model import DFlashDraft


def make_layout(batch: Batch, signal: Signal, seed: int, device: torch.device, backend: str) -> BlockLayout:
    """Draw each sequence's anchors (seeded by run seed, epoch and sample ID) and lay out the blocks."""
    anchors, start = [], 0
    mask = batch.loss_mask.bool().cpu()
    for sample, L in zip(batch.samples, batch.seq_lens):
        s = anchor_seed(seed, batch.epoch, sample)
        anchors.append(sample_anchors(mask[start : start + L], signal.block_size, signal.anchors, s,
                                      signal.anchor_every))
        start += L
    return build_layout(batch.seq_lens, anchors, signal.block_size, device, backend)


def noise_seed(seed: int, epoch: int, sample_id: int, step: int) -> int:
    """Per (run seed, epoch, sample, step) seed of a sequence's feature noise.

    Not the global RNG: a draw over the whole batch would depend on how the batch is cut
    (an OOM split into micro-batches, another packing, another rank) and the split step
    would train on other noise than the step it replaces. Seeded per sequence, a sample
    gets the same noise however its step is cut or spread over ranks, and fresh noise
    each time it is trained (the step is in the seed), even when a local stream repeats it."""
    digest = hashlib.sha256(f"noise:{seed}:{epoch}:{sample_id}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def add_feature_noise(
    hidden: torch.Tensor, n_layers: int, sigma: float, seq_lens: list[int], seeds: list[int]
) -> torch.Tensor:
    """hidden + sigma * rms * N(0, 1), rms per token and per target layer; the N(0, 1) of
    each sequence (rows of `seq_lens`) drawn from its own seed (`noise_seed`).

    Relative to each layer's own scale: target layers differ in magnitude by orders, so
    one absolute sigma would drown shallow layers and not touch deep ones."""
    if sigma <= 0:
        return hidden
    T = hidden.shape[0]
    x = hidden.view(T, n_layers, -1)  # [T, n, D]
    rms = x.float().pow(2).mean(-1, keepdim=True).sqrt()  # [T, n, 1]
    z = torch.empty(x.shape, device=x.device)
    start = 0
    for L, s in zip(seq_lens, seeds):
        g = torch.Generator(device=x.device).manual_seed(s)
        z[start : start + L].normal_(generator=g)  # rows of one sequence: contiguous
        start += L
    noisy = x + (z * (sigma * rms)).to(x.dtype)
    return noisy.view(T, -1)


def draft_states(
    model: DFlashDraft, heads: TargetHeads, batch: Batch, layout: BlockLayout, signal: Signal, noise: float = 0.0,
    *, seed: int = 0, step: int = 0,
) -> torch.Tensor:
    """The drafter's final-normed states for every block position, [Q, D]. Feature noise
    (sigma `noise`) is seeded per sequence by (`seed`, epoch, sample, `step`)."""
    device = heads.embed.device
    ids = batch.input_ids.to(device)
    block_ids = layout.block_input_ids(ids, signal.mask_token_id)  # [Q]: anchor, MASK, ...
    x = heads.embed_ids(block_ids)  # [Q, D]: what the target's embedding module gives (Gemma scales it)
    features = batch.hidden.to(device=device, dtype=heads.embed.dtype, non_blocking=True)  # [T, n*D]
    if noise > 0:
        seeds = [noise_seed(seed, batch.epoch, s, step) for s in batch.samples]
        features = add_feature_noise(features, len(signal.target_layers), noise, batch.seq_lens, seeds)
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
    step: int = 0,
) -> tuple[torch.Tensor | None, LossStats]:
    """(sum of weighted CE over the batch's block positions, stats). None for the loss
    when the batch has no anchor (all prompts, or sequences shorter than a block).

    Every term is per sequence (anchors and noise seeded per sample, attention within a
    sequence, a loss summed over positions): the sums of the batch's parts are the
    batch's sums, which is what splitting a step into micro-batches relies on (step_oom.py)."""
    device = heads.embed.device
    layout = make_layout(batch, signal, seed, device, backend)
    if layout.num_queries == 0:
        return None, LossStats(pos_correct=[0] * (signal.block_size - 1), pos_valid=[0] * (signal.block_size - 1))
    h = draft_states(model, heads, batch, layout, signal, noise, seed=seed, step=step)  # [Q, D]
    labels, valid = layout.labels(batch.input_ids.to(device), batch.loss_mask.to(device))
    soft = None
    if signal.distill > 0:  # the target's final state at the token before each label predicts it
        soft = batch.final_hidden.to(device=device, dtype=heads.embed.dtype)[(layout.q_index - 1).clamp(min=0)]
    return block_loss(h, heads.lm_head, labels, valid, signal.block_size, signal.gamma, loss_chunk, soft,
                      signal.distill, signal.loss, signal.dpace_alpha or 0.5)
