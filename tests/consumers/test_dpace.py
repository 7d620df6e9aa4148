"""--loss dpace (D-PACE, docs/TRAINING.md): its weights by hand, the chunked loss and its
gradient against a plain autograd reference on full logits, the training signal's rules,
and a tiny target that learns with it."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, random_batch, rule_batch
from dflash.consumers.drafter.loss import block_loss, dpace_weights
from dflash.consumers.training.train import train
from dflash.consumers.training.train_config import resolve_signal
from dflash.consumers.training.config import TrainConfig
from dflash.protocol.training_signal import SignalMismatch

pytestmark = pytest.mark.unit


def test_weights_by_hand():
    q = torch.tensor([0.3, 0.9, 0.5, 0.2])  # position 0 is the anchor: its q is never read
    valid = torch.tensor([False, True, True, True])
    # alpha 0.5: smoothed 0.95, 0.75, 0.6; prefixes 0.95, 0.7125, 0.4275; suffix sums of those
    torch.testing.assert_close(dpace_weights(q, valid, 4, 0.5), torch.tensor([0.0, 2.09, 1.14, 0.4275]))
    # alpha 1: every prefix counts 1, the weight is the number of positions with loss from j on
    torch.testing.assert_close(dpace_weights(q, valid, 4, 1.0), torch.tensor([0.0, 3.0, 2.0, 1.0]))
    # a position without loss: a factor 1 in the products, no term in the sums, weight 0
    hole = torch.tensor([False, True, False, True])
    torch.testing.assert_close(dpace_weights(q, hole, 4, 0.5), torch.tensor([0.0, 0.95 + 0.57, 0.0, 0.57]))
    # two blocks are independent
    two = dpace_weights(torch.cat([q, q.flip(0)]), torch.cat([valid, hole]), 4, 0.5)
    torch.testing.assert_close(two[:4], dpace_weights(q, valid, 4, 0.5))
    torch.testing.assert_close(two[4:], dpace_weights(q.flip(0), hole, 4, 0.5))


def _reference(h, W, labels, valid, B, alpha, soft=None, distill=0.0):
    """D-PACE written out from its definition on the full [Q, V] logits, one block and one
    position at a time; torch autograd gives the gradient."""
    logits = h @ W.T
    ce = F.cross_entropy(logits, labels, reduction="none")
    row = ce
    if distill > 0:
        logp, logq = torch.log_softmax(logits, -1), torch.log_softmax(soft @ W.T, -1)
        row = (1 - distill) * ce + distill * (logq.exp() * (logq - logp)).sum(-1)
    q = torch.exp(-ce).detach().tolist()
    total = h.new_zeros(())
    for b in range(h.shape[0] // B):
        idx = [b * B + k for k in range(B) if bool(valid[b * B + k])]
        prefix, p = [], 1.0
        for i in idx:
            p *= (1 - alpha) * q[i] + alpha
            prefix.append(p)
        for n, i in enumerate(idx):
            total = total + sum(prefix[n:]) * row[i]
    return total


@pytest.mark.parametrize("alpha,distill", [(0.5, 0.0), (0.2, 0.0), (1.0, 0.0), (0.5, 0.4)])
def test_chunked_loss_and_gradient_equal_the_reference(alpha, distill):
    g = torch.Generator().manual_seed(1)
    B, n_blocks, D, V = 5, 9, 12, 37
    Q = B * n_blocks
    W = torch.randn(V, D, generator=g)
    h0 = 2.0 * torch.randn(Q, D, generator=g)
    soft = torch.randn(Q, D, generator=g)
    labels = torch.randint(0, V, (Q,), generator=g)
    valid = torch.rand(Q, generator=g) > 0.25  # holes inside blocks and at their ends
    valid[::B] = False  # anchors have no loss
    valid[2 * B : 3 * B] = False  # a block without loss
    ref_h = h0.clone().requires_grad_(True)
    ref = _reference(ref_h, W, labels, valid, B, alpha, soft, distill)
    ref.backward()
    blocks_with_loss = int(valid.view(-1, B).any(1).sum())
    for chunk in (1, 4, 7, 1000):  # one row at a time, chunks that split blocks, all at once
        h = h0.clone().requires_grad_(True)
        loss, stats = block_loss(h, W, labels, valid, B, gamma=3.0, chunk=chunk, soft=soft, distill=distill,
                                 loss="dpace", dpace_alpha=alpha)
        (2.0 * loss).backward()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h.grad, 2.0 * ref_h.grad, rtol=1e-4, atol=1e-6)
        assert stats.weight == blocks_with_loss and stats.blocks == blocks_with_loss
        assert stats.valid == int(valid.sum())
        assert stats.correct == int(((h0 @ W.T).argmax(-1) == labels)[valid].sum())


def test_dpace_is_not_the_decayed_ce_and_ce_is_unchanged():
    g = torch.Generator().manual_seed(2)
    B, Q, D, V = 4, 24, 8, 20
    h, W = torch.randn(Q, D, generator=g), torch.randn(V, D, generator=g)
    labels, valid = torch.randint(0, V, (Q,), generator=g), torch.ones(Q, dtype=torch.bool)
    valid[::B] = False
    ce, ce_stats = block_loss(h, W, labels, valid, B, gamma=3.0, chunk=5)
    w = torch.exp(-(torch.arange(B) - 1).clamp(min=0) / 3.0).repeat(Q // B) * valid
    torch.testing.assert_close(ce, (F.cross_entropy(h @ W.T, labels, reduction="none") * w).sum())
    assert ce_stats.weight == pytest.approx(float(w.sum()))
    dp, _ = block_loss(h, W, labels, valid, B, gamma=3.0, chunk=5, loss="dpace")
    assert abs(float(dp) - float(ce)) > 1e-3
    with pytest.raises(ValueError, match="none of ce, dpace"):
        block_loss(h, W, labels, valid, B, gamma=3.0, loss="kl")


LAYERS = [1, 2]
CFG = TrainConfig(draft_layers=1, target_layers=tuple(LAYERS), block_size=4, anchors=8, lr=3e-3,
                  mask_token_id=MASK_ID, loss="dpace", log_position_every=0, save_every=0)


def test_the_signal_records_the_loss_and_refuses_what_it_would_not_use(heads):
    ce = resolve_signal(replace(CFG, loss="ce"), heads)
    assert (ce.loss, ce.dpace_alpha) == ("ce", None)
    dp = resolve_signal(CFG, heads)
    assert (dp.loss, dp.dpace_alpha) == ("dpace", 0.5)
    assert resolve_signal(replace(CFG, dpace_alpha=0.3), heads).dpace_alpha == 0.3
    assert dp.gamma == ce.gamma  # the default is recorded as before; dpace never reads it
    with pytest.raises(ValueError, match="--gamma"):
        resolve_signal(replace(CFG, gamma=3.0), heads)
    with pytest.raises(ValueError, match="--loss dpace"):
        resolve_signal(replace(CFG, loss="ce", dpace_alpha=0.5), heads)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"--dpace-alpha .* \(0, 1\]"):
            resolve_signal(replace(CFG, dpace_alpha=bad), heads)
    with pytest.raises(ValueError, match="--loss 'kl'"):
        resolve_signal(replace(CFG, loss="kl"), heads)


def test_a_resume_with_another_loss_or_alpha_is_refused(heads, tmp_path):
    root = tmp_path / "checkpoints"
    batches = [random_batch(heads.spec, LAYERS, [24, 17], seed=i, batch_id=f"b{i}", sample_start=10 * i)
               for i in range(5)]
    with capture_logs():
        train(replace(CFG, loss="ce", max_steps=2), heads, batches[:2], ckpt_root=root)
        ck = str(root / "step-2")
        with pytest.raises(SignalMismatch, match="loss: 'ce' -> 'dpace'"):
            train(replace(CFG, resume=ck), heads, batches[2:])
        train(replace(CFG, resume=ck, force=True, max_steps=3, save_every=1), heads, batches[2:3],
              ckpt_root=tmp_path / "dp")
        with pytest.raises(SignalMismatch, match="dpace_alpha: 0.5 -> 0.3"):
            train(replace(CFG, dpace_alpha=0.3, resume=str(tmp_path / "dp" / "step-3")), heads, batches[3:])


def test_a_drafter_learns_with_dpace(heads):
    batches = [rule_batch(heads.spec, LAYERS, seed=i, n_seqs=4, seq_len=24) for i in range(30)]
    with capture_logs() as logs:
        state = train(replace(CFG, total_samples=30 * 4), heads, iter(batches))
    steps = [e for e in logs if e["event"] == "train.step"]
    losses = [e["loss"] for e in steps]
    assert state.step == 30 and len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, " ".join(str(round(x, 2)) for x in losses)
    assert sum(e["streak"] for e in steps[-5:]) > sum(e["streak"] for e in steps[:5])
    signal = [e for e in logs if e["event"] == "train.start"][0]["signal"]
    assert (signal["loss"], signal["dpace_alpha"]) == ("dpace", 0.5)
