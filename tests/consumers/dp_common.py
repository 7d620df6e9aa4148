"""What both data-parallel ranks and the single-process reference train on."""

import torch

from tests.harness.tiny import MASK_ID, random_batch
from dflash.protocol.batch import Batch
from dflash.consumers.training.config import TrainConfig

LAYERS = [1, 2]
CFG = TrainConfig(draft_layers=2, target_layers=tuple(LAYERS), block_size=4, anchors=6, mask_token_id=MASK_ID,
                  lr=1e-3, total_steps=6, log_position_every=0)
# Rank 0 has 4 batches, rank 1 only 3 and of other sizes: its 4th step is an empty step.
SHAPES = {0: [[24, 17], [30], [20, 20, 12], [26]], 1: [[40], [18, 22], [25]]}


def rank_batches(spec, rank: int) -> list[Batch]:
    return [random_batch(spec, LAYERS, lens, seed=100 * rank + i, batch_id=f"r{rank}-{i}",
                         sample_start=1000 * rank + 10 * i) for i, lens in enumerate(SHAPES[rank])]


def union(a: Batch, b: Batch | None) -> Batch:
    """Both ranks' batches packed into one, as a single process would receive them."""
    if b is None:
        return a
    return Batch.packed(a.samples + b.samples, a.seq_lens + b.seq_lens, torch.cat([a.input_ids, b.input_ids]),
                        torch.cat([a.loss_mask, b.loss_mask]), torch.cat([a.hidden, b.hidden]),
                        batch_id=f"{a.batch_id}+{b.batch_id}", layer_ids=a.layer_ids, epoch=a.epoch)
