"""Drafters of 1 to N layers (--draft-layers) for small targets: each trains, exports and
loads back through load_exported with the trained weights (bf16-rounded, as exported)."""

import json

import pytest
import torch
import torch.nn.functional as F
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, rule_batch
from dflash.consumers.drafter.blocks import build_layout
from dflash.consumers.export.export import export_checkpoint, load_exported
from dflash.consumers.training.train import train
from dflash.consumers.training.config import TrainConfig

pytestmark = pytest.mark.unit

LAYERS = [1, 2]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_n_draft_layers_train_export_and_load(n, heads, tmp_path):
    cfg = TrainConfig(draft_layers=n, target_layers=tuple(LAYERS), block_size=4, anchors=6, mask_token_id=MASK_ID,
                      lr=2e-2, log_position_every=0, save_every=0)
    with capture_logs():
        state = train(cfg, heads, (rule_batch(heads.spec, LAYERS, seed=i) for i in range(2)),
                      ckpt_root=tmp_path / "checkpoints")
    out = export_checkpoint(state.last_checkpoint, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == n
    exported = load_exported(out)
    assert len(exported.model.layers) == n
    trained = state.model.cpu().eval()
    with torch.no_grad():  # the export folds training's feature_scale into fc.weight, then rounds
        trained.fc.weight.mul_(trained.feature_scale[None, :])
        trained.feature_scale.fill_(1.0)
    for p in trained.parameters():
        p.data = p.data.to(torch.bfloat16).float()  # what the bf16 export holds
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(12, len(LAYERS) * heads.spec.hidden_size, generator=g)
    x = F.embedding(torch.tensor([7] + [MASK_ID] * 3), heads.embed)
    layout = build_layout([12], [torch.tensor([12])], 4, torch.device("cpu"))
    with torch.no_grad():
        assert torch.equal(exported.model(feats, x, layout), trained(feats, x, layout))
