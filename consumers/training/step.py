"""One batch through the drafter: anchors, block inputs, forward, chunked loss, backward.
Apart from the loop (train.py) so the tests and the loop run the very same code."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import partial

import torch

from dflash.consumers.drafter.blocks import BlockLayout, LayoutPlan, anchor_seed, plan_layout, sample_anchors
from dflash.consumers.drafter.loss import LossStats, block_loss, known_figures
from dflash.consumers.drafter.mask_token import mask_in_batch
from dflash.consumers.drafter.model import DFlashDraft
from dflash.protocol.training_signal import Signal
from dflash.runtime.target_heads import TargetHeads

from dflash.protocol.batch import Batch
from .step_oom import StepSplitter


def forward_backward(
    model: DFlashDraft,
    heads: TargetHeads,
    batch: Batch,
    signal: Signal,
    *,
    seed: int,
    step: int,
    noise: float = 0.0,
    backend: str = "sdpa",
    loss_chunk: int = 2048,
    bf16: bool = False,
    splitter: StepSplitter | None = None,
) -> LossStats:
    """Forward and backward of `batch`: d(sum of weighted CE) added to every `.grad` (the caller
    divides by the global weight); with a `splitter`, in as many micro-batches as memory needs."""
    if splitter is not None:
        one_part = partial(forward_backward, model, heads, signal=signal, seed=seed, step=step, noise=noise,
                           backend=backend, loss_chunk=loss_chunk, bf16=bf16)
        return splitter.run(batch, one_part, step)
    with torch.autocast(heads.embed.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss_sum, stats = batch_loss(model, heads, batch, signal, seed=seed, backend=backend, noise=noise,
                                     loss_chunk=loss_chunk, step=step, defer=True)
    if loss_sum is not None:
        loss_sum.backward()
    return stats


@dataclass
class StepPlan:
    """What a step needs from its batch on the host, made ahead on the staging thread."""

    layout: LayoutPlan
    known: LossStats | None  # loss.known_figures of the layout's valid positions
    mask_hits: int | None  # tokens that are the MASK token (None: not counted)
    key: tuple


def plan_key(signal: Signal, seed: int, device: torch.device, backend: str) -> tuple:
    return (seed, signal.block_size, signal.anchors, signal.anchor_every, signal.gamma, signal.mask_token_id,
            device.type, backend)


def plan_step(batch: Batch, signal: Signal, seed: int, device: torch.device, backend: str,
              count_mask: bool = False) -> StepPlan:
    """Draw each sequence's anchors and lay out the blocks, on the host."""
    anchors, start = [], 0
    mask = (batch.host_loss_mask if batch.host_loss_mask is not None else batch.loss_mask).bool().cpu()
    for sample, L in zip(batch.samples, batch.seq_lens):
        s = anchor_seed(seed, batch.epoch, sample)
        anchors.append(sample_anchors(mask[start : start + L], signal.block_size, signal.anchors, s,
                                      signal.anchor_every))
        start += L
    hits = None
    if count_mask:
        hits = mask_in_batch(batch.host_input_ids if batch.host_input_ids is not None else batch.input_ids,
                             signal.mask_token_id)
    layout = plan_layout(batch.seq_lens, anchors, signal.block_size, device, backend, loss_mask=mask)
    known = known_figures(layout.valid, signal.block_size, signal.gamma) if layout.valid is not None else None
    return StepPlan(layout, known, hits, plan_key(signal, seed, device, backend))


def make_layout(batch: Batch, signal: Signal, seed: int, device: torch.device, backend: str) -> BlockLayout:
    plan = batch.plan
    if not isinstance(plan, StepPlan) or plan.key != plan_key(signal, seed, device, backend):
        plan = plan_step(batch, signal, seed, device, backend)
    layout = plan.layout.to_device(device)
    layout.known = plan.known
    return layout


def noise_seed(seed: int, epoch: int, sample_id: int, step: int) -> int:
    """Per (seed, epoch, sample, step) noise seed: not the global RNG, whose draw would depend on how
    the batch is cut (an OOM split, another rank), so a split step would train on other noise."""
    digest = hashlib.sha256(f"noise:{seed}:{epoch}:{sample_id}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def add_feature_noise(
    hidden: torch.Tensor, n_layers: int, sigma: float, seq_lens: list[int], seeds: list[int]
) -> torch.Tensor:
    """hidden + sigma * rms * N(0, 1), rms per token and layer: layers differ in scale by orders, so
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
    """The drafter's final-normed states for every block position, [Q, D]."""
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
    defer: bool = False,
) -> tuple[torch.Tensor | None, LossStats]:
    """(sum of weighted CE, stats); loss None without anchors. Every term is per sequence, so parts'
    sums are the batch's: what micro-batches rely on (step_oom.py)."""
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
                      signal.distill, signal.loss, signal.dpace_alpha or 0.5, rows=layout.rows, known=layout.known,
                      defer=defer)
