"""The drafter step reads nothing back from the device but its figures, once a step, and
stays lean in ops: counted on a SmolLM2-shaped tiny target in steady state (the real
Trainer, the staging thread planning each batch ahead: tests/harness/step_ops.py). And the
planned, deferred path computes exactly what the direct one does."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.harness.step_ops import count_training, fake_smol_target
from dflash.consumers.drafter.loss import block_loss
from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig
from dflash.consumers.training.step import batch_loss, draft_states, make_layout, plan_step
from dflash.consumers.process.synthetic import rule_batch
from dflash.consumers.training.train_config import resolve_signal
from dflash.consumers.training.config import TrainConfig
from dflash.runtime.target_heads import load_target_heads

pytestmark = pytest.mark.unit

# Ops a steady-state step dispatches in the training thread (sdpa on the CPU, the optimizer
# step left out): the counted figure with some headroom, below the figure before the step
# was planned ahead (docs/BENCHMARKS.md has both).
MAX_OPS_PER_STEP = 1200


def test_a_steady_state_step_reads_back_once(tmp_path):
    got = count_training(tmp_path / "target", steps=4)
    # The one read: the loss figures and the gradient norm together, before the optimizer step
    assert got["syncs"] == {"tolist": got["steps"]}, got["syncs"]
    assert got["ops_per_step"] <= MAX_OPS_PER_STEP, got["top_ops"]
    assert all(loss is not None and loss > 0 for loss in got["losses"])


def test_the_trajectory_is_the_same_planned_ahead_or_in_the_step(tmp_path):
    staged = count_training(tmp_path / "a", steps=2, warm=2)
    inline = count_training(tmp_path / "b", steps=2, warm=2, stage_batches=False)
    assert staged["losses"] == inline["losses"] and staged["weights_sha256"] == inline["weights_sha256"]
    # Without the stager the plan is made in the step: its host work shows in the count (the
    # anchors' nonzero, the loss mask's copy, the known figures' read), as it would on a GPU.
    assert staged["syncs_per_step"] == 1 and inline["syncs"]["nonzero"] > 0 and inline["syncs"]["cpu"] > 0


@pytest.mark.parametrize("plan_ahead", [True, False])
def test_planned_deferred_loss_equals_the_direct_loss(tmp_path, plan_ahead):
    heads = load_target_heads(fake_smol_target(tmp_path / "t"), dtype=torch.float32)
    cfg = TrainConfig(block_size=8, anchors=16, draft_layers=2, mask_token_id=511)
    signal = resolve_signal(cfg, heads)
    batch = rule_batch(heads.spec, list(signal.target_layers), seed=3, n_seqs=3, seq_len=50)
    if plan_ahead:  # as the stager does
        batch = batch.with_host_facts(batch.input_ids.clone(), batch.loss_mask.clone())
        batch = replace(batch, plan=plan_step(batch, signal, 7, torch.device("cpu"), "sdpa", count_mask=True))
        assert batch.plan.mask_hits == 0
    grads = []
    for path in ("deferred", "direct"):
        torch.manual_seed(0)
        model = DFlashDraft(DrafterConfig.from_target(heads.spec, 2, len(signal.target_layers)))
        if path == "deferred":
            loss, stats = batch_loss(model, heads, batch, signal, seed=7, loss_chunk=32, defer=True)
            assert stats.pending is not None
            (norm,) = stats.read(loss.detach())
            assert norm == float(loss.detach())
        else:  # the loss finds its rows and every figure on the device, read at once
            layout = make_layout(batch, signal, 7, torch.device("cpu"), "sdpa")
            h = draft_states(model, heads, batch, layout, signal)
            labels, valid = layout.labels(batch.input_ids, batch.loss_mask)
            loss, stats = block_loss(h, heads.lm_head, labels, valid, 8, signal.gamma, 32)
            assert stats.pending is None
        loss.backward()
        grads.append((float(loss), stats, [p.grad.clone() for p in model.parameters()]))
    (l1, s1, g1), (l2, s2, g2) = grads
    assert l1 == l2
    assert (s1.loss_sum, s1.weight, s1.valid, s1.correct, s1.streak, s1.blocks, s1.pos_correct, s1.pos_valid) == \
        (s2.loss_sum, s2.weight, s2.valid, s2.correct, s2.streak, s2.blocks, s2.pos_correct, s2.pos_valid)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
