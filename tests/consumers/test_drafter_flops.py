"""consumers/training/flops.py, the numerator of the drafter's MFU, checked against what really runs:
torch's FLOP counter over one real training step (forward and backward) for the matrix
work, and the attention masks the step builds for the attended keys."""

import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.harness.tiny import MASK_ID, random_batch
from dflash.consumers.drafter.blocks import _seq_mask
from dflash.protocol.training_signal import Signal
from dflash.consumers.training.flops import StepShape, step_flops, step_shape
from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig
from dflash.consumers.training.step import batch_loss, make_layout
import pytest

pytestmark = pytest.mark.unit

LAYERS, B, ANCHORS, SEED = [1, 2], 4, 6, 3
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm"}


def _signal(heads):
    return Signal(anchors=ANCHORS, block_size=B, target_layers=tuple(LAYERS), gamma=4.0, draft_layers=2,
                  mask_token_id=MASK_ID, target=heads.identity)


def test_matrix_flops_equal_torchs_count_of_a_real_step(heads):
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(heads.spec, 2, len(LAYERS))
    model = DFlashDraft(cfg)
    batch = random_batch(heads.spec, LAYERS, [30, 17, 25], seed=1)
    shape = step_shape(batch, B, ANCHORS, SEED)
    assert shape.queries == make_layout(batch, _signal(heads), SEED, torch.device("cpu"), "sdpa").num_queries
    counter = FlopCounterMode(display=False)
    with counter:
        loss, _ = batch_loss(model, heads, batch, _signal(heads), seed=SEED, backend="sdpa")
        loss.backward()
    counted = sum(n for op, n in counter.get_flop_counts()["Global"].items() if op.__name__.split(".")[0] in MATMUL_OPS)
    # The LM head sees only the positions with a label (not the anchors); without attention,
    # the formula's matrix part is all the matrix work torch counted.
    work = StepShape(shape.context_tokens, shape.queries, scored=shape.scored, attended_keys=0)
    assert counted == step_flops(cfg, heads.spec.vocab_size, work)


def test_attended_keys_are_the_masks_true_entries(heads):
    batch = random_batch(heads.spec, LAYERS, [30, 17, 25, 9], seed=2)
    layout = make_layout(batch, _signal(heads), SEED, torch.device("cpu"), "sdpa")
    in_masks = sum(int(_seq_mask(a, L, B).sum()) for a, L in zip(layout.anchors, batch.seq_lens) if a.numel())
    assert step_shape(batch, B, ANCHORS, SEED).attended_keys == in_masks > 0
