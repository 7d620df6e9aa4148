"""Feature standardisation (model.py feature_scale): a pretrained target's features have a
few columns hundreds of times louder than the rest ("massive activations"); the drafter
standardises each column from the first batch, so it learns the context at once instead of
first learning to ignore those columns, and the export folds the factors into fc.weight."""

from dataclasses import replace

import pytest
import torch
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, rule_batch
from dflash.consumers.export.export import export_checkpoint, load_exported
from dflash.consumers.drafter.model import calibrate_features
from dflash.consumers.training.train import train
from dflash.consumers.training.config import TrainConfig

pytestmark = pytest.mark.unit

LAYERS, B, STEPS = [1, 2], 4, 150
LOUD = [3, 70, 100]  # columns of the concatenated features, in both target layers' slices


def _loud(batch, seed):
    """The batch with three columns made like a pretrained target's massive activations: about
    1000x the others, nearly constant, carrying nothing about the tokens."""
    h = batch.hidden.clone()
    g = torch.Generator().manual_seed(seed)
    for c in LOUD:
        h[:, c] = 1000.0 + torch.randn(h.shape[0], generator=g)
    return replace(batch, tensors={**batch.tensors, "hidden": h})


def _stream(heads, n):
    return [_loud(rule_batch(heads.spec, LAYERS, seed=i, sample_start=4 * i), i) for i in range(n)]


def _cfg(**kw):
    return TrainConfig(**{"draft_layers": 2, "target_layers": tuple(LAYERS), "block_size": B, "anchors": 8,
                          "mask_token_id": MASK_ID, "lr": 3e-3, "total_steps": STEPS, "log_position_every": 0,
                          "save_every": 0, **kw})


def test_first_batch_sets_one_factor_per_column(heads):
    batches = _stream(heads, 3)
    with capture_logs() as logs:
        state = train(replace(_cfg(), max_steps=3), heads, batches)
    first = batches[0].hidden.double()
    rms = first.pow(2).mean(0).sqrt()
    want = 1.0 / rms.clamp_min(0.1 * float(rms.median()))
    torch.testing.assert_close(state.model.feature_scale.double(), want, rtol=1e-5, atol=0)
    assert float(state.model.feature_scale[LOUD[0]]) < 0.01 * float(state.model.feature_scale.median())
    lines = [e for e in logs if e["event"] == "train.feature_scale"]
    assert len(lines) == 1 and lines[0]["tokens"] == first.shape[0]  # set once, from step 1's batch


def test_off_keeps_the_plain_fc(heads):
    with capture_logs():
        state = train(replace(_cfg(feature_scaling=False), max_steps=2), heads, _stream(heads, 2))
    assert torch.equal(state.model.feature_scale, torch.ones_like(state.model.feature_scale))


def test_standardised_features_learn_the_context_where_raw_ones_do_not_yet(heads):
    """Same batches, same steps: with the loud columns standardised the drafter reads the
    context; with them raw it is still far behind (the SmolLM2 runs' failure, in small)."""
    results = {}
    for on in (True, False):
        with capture_logs() as logs:
            train(_cfg(feature_scaling=on), heads, _stream(heads, STEPS))
        tail = [e for e in logs if e["event"] == "train.step"][-10:]
        results[on] = (sum(e["loss"] for e in tail) / 10, sum(e["acc"] for e in tail) / 10)
    assert results[True][1] > 0.8 and results[False][1] < 0.5, results
    assert results[True][0] < 0.4 * results[False][0], results


def test_export_folds_the_factors_into_fc(heads, tmp_path):
    with capture_logs():
        state = train(replace(_cfg(save_every=4), max_steps=4), heads, _stream(heads, 4), ckpt_root=tmp_path / "c")
    out = export_checkpoint(state.last_checkpoint, tmp_path / "export")
    exported = load_exported(out)
    trained = state.model.cpu()
    want = (trained.fc.weight * trained.feature_scale[None, :]).to(torch.bfloat16).float()
    assert torch.equal(exported.model.fc.weight, want)
    assert torch.equal(exported.model.feature_scale, torch.ones_like(trained.feature_scale))


def test_a_quiet_column_is_raised_at_most_tenfold():
    from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig

    model = DFlashDraft(DrafterConfig(hidden_size=4, intermediate_size=8, num_attention_heads=1,
                                      num_key_value_heads=1, head_dim=4, num_layers=1, num_features=1))
    rms = torch.tensor([1.0, 2.0, 1e-9, 500.0])
    calibrate_features(model, rms.pow(2) * 10, 10)
    # median RMS (the lower middle value) 1: the silent column gets 1 / 0.1, the loud one 1 / 500
    torch.testing.assert_close(model.feature_scale, torch.tensor([1.0, 0.5, 10.0, 1 / 500]))
