"""Anchors, labels, weights and the chunked loss."""

import math

import torch
import torch.nn.functional as F

from dflash.consumers.drafter.blocks import anchor_seed, build_layout, sample_anchors
from dflash.consumers.drafter.loss import ChunkedCE, block_loss, default_gamma, position_weights
import pytest

pytestmark = pytest.mark.unit


def test_anchors_are_response_tokens_that_leave_room_for_a_block():
    mask = torch.zeros(40, dtype=torch.bool)
    mask[10:40] = True  # response from 10 to the end
    for seed in range(20):
        a = sample_anchors(mask, 8, 5, seed)
        assert len(a) == 5 and bool((a[1:] > a[:-1]).all())
        assert int(a.min()) >= 10 and int(a.max()) <= 40 - 8
    all_valid = sample_anchors(mask, 8, 512, 0)  # more asked than exist: all 23 of them
    assert all_valid.tolist() == list(range(10, 33))
    assert sample_anchors(torch.ones(5, dtype=torch.bool), 8, 4, 0).numel() == 0  # shorter than a block


def test_anchor_every_n_draws_one_per_n_trainable_positions_within_the_cap():
    mask = torch.zeros(40, dtype=torch.bool)
    mask[10:40] = True  # 23 trainable positions for blocks of 8
    assert sample_anchors(mask, 8, 512, 0, every=3).numel() == 8  # ceil(23 / 3)
    assert sample_anchors(mask, 8, 5, 0, every=3).numel() == 5  # --anchors still caps it
    assert sample_anchors(mask, 8, 512, 0, every=1).tolist() == list(range(10, 33))
    few = sample_anchors(mask, 8, 512, 7, every=3)
    assert set(few.tolist()) <= set(range(10, 33)) and bool((few[1:] > few[:-1]).all())


def test_anchors_are_redrawn_each_epoch_and_replayable():
    mask = torch.ones(200, dtype=torch.bool)
    def draw(epoch: int, sample: int) -> list[int]:
        return sample_anchors(mask, 16, 8, anchor_seed(0, epoch, sample)).tolist()

    assert draw(0, 5) == draw(0, 5)
    assert draw(0, 5) != draw(1, 5) and draw(0, 5) != draw(0, 6)


def test_labels_are_the_tokens_at_anchor_plus_k():
    ids = torch.arange(100, 130)  # token value = 100 + position: labels are easy to read
    loss_mask = torch.ones(30, dtype=torch.bool)
    loss_mask[:5] = False
    loss_mask[20] = False  # a non-response token inside a block
    layout = build_layout([30], [torch.tensor([5, 17])], 4, torch.device("cpu"))
    labels, valid = layout.labels(ids, loss_mask)
    assert labels.tolist() == [105, 106, 107, 108, 117, 118, 119, 120]
    assert valid.tolist() == [False, True, True, True, False, True, True, False]
    assert layout.block_input_ids(ids, 999).tolist() == [105, 999, 999, 999, 117, 999, 999, 999]
    assert layout.q_pos.tolist() == [5, 6, 7, 8, 17, 18, 19, 20]


def test_default_gamma_and_weights():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    assert default_gamma(32) == 13.0
    w = position_weights(16, 7.0)
    assert w[1] == 1.0 and math.isclose(float(w[8]), math.exp(-1.0), rel_tol=1e-6)


def test_chunked_ce_equals_full_cross_entropy_in_value_and_gradient():
    torch.manual_seed(0)
    Q, D, V = 24, 16, 50
    h = torch.randn(Q, D, dtype=torch.float64, requires_grad=True)
    W = torch.randn(V, D, dtype=torch.float64)
    y = torch.randint(0, V, (Q,))
    w = torch.rand(Q, dtype=torch.float64) * (torch.rand(Q) > 0.3)
    loss, preds = ChunkedCE.apply(h, W, y, w, 5)  # chunks of 5 rows, the last one short
    (g,) = torch.autograd.grad(3.0 * loss, h)
    h2 = h.detach().clone().requires_grad_(True)
    full = (F.cross_entropy(h2 @ W.T, y, reduction="none") * w).sum()
    (g2,) = torch.autograd.grad(3.0 * full, h2)
    torch.testing.assert_close(loss.double(), full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g, g2)
    assert torch.equal(preds, (h @ W.T).argmax(-1))


def test_metrics_acc_streak_and_per_position():
    B, V = 4, 8
    labels = torch.tensor([0, 1, 2, 3, 0, 4, 5, 6])
    valid = torch.tensor([False, True, True, True, False, True, True, True])
    # logits that put argmax on: block 0 all right; block 1 right, wrong, right
    pred = torch.tensor([0, 1, 2, 3, 0, 4, 0, 6])
    h = F.one_hot(pred, V).double() * 10
    loss, st = block_loss(h, torch.eye(V, dtype=torch.float64), labels, valid, B, gamma=4.0, chunk=4)
    assert (st.valid, st.correct, st.blocks) == (6, 5, 2)
    assert st.streak == 3 + 1  # block 0: 3 in a row, block 1: 1 then a miss
    assert st.pos_correct == [2, 1, 2] and st.pos_valid == [2, 2, 2]
    assert math.isclose(st.weight, 2 * (1 + math.exp(-1 / 4) + math.exp(-2 / 4)), rel_tol=1e-6)
