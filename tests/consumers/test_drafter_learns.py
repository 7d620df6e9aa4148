"""The drafter learns a stream whose continuation is a function of the context, and what it
learnt is what an inference engine asks of it (this is what catches shifted labels)."""

import torch
import torch.nn.functional as F
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, rule_batch
from dflash.consumers.drafter.blocks import build_layout
from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig
from dflash.consumers.training.train import train
from dflash.consumers.training.config import TrainConfig
import pytest

pytestmark = pytest.mark.unit

LAYERS, B, STEPS = [1, 2], 4, 300


def _draft_like_an_engine(model, heads, ids, feats, a):
    """As an inference engine runs it: the drafter gets target features of the tokens already
    verified (positions < a) and [x_a, MASK x (B-1)]; it proposes tokens a+1..a+B-1."""
    layout = build_layout([a], [torch.tensor([a])], B, torch.device("cpu"))  # the whole context is visible
    x = F.embedding(torch.tensor([int(ids[a])] + [MASK_ID] * (B - 1)), heads.embed)
    with torch.no_grad():
        h = model(feats[:a], x, layout)
    return (h @ heads.lm_head.T).argmax(-1)[1:].tolist()


def test_loss_goes_to_zero_and_drafts_match_the_stream(heads):
    cfg = TrainConfig(draft_layers=2, target_layers=tuple(LAYERS), block_size=B, anchors=8,
                      mask_token_id=MASK_ID, lr=3e-3, total_steps=STEPS, log_position_every=100)
    stream = (rule_batch(heads.spec, LAYERS, seed=i, sample_start=4 * i) for i in range(STEPS))
    with capture_logs() as logs:
        state = train(cfg, heads, stream)
    steps = [e for e in logs if e["event"] == "train.step"]
    assert len(steps) == STEPS and state.end_reason == "end_of_stream"
    assert steps[0]["loss"] > 3.0  # it starts out knowing nothing
    tail = steps[-20:]
    assert sum(e["loss"] for e in tail) / 20 < 0.05
    assert min(e["acc"] for e in tail) > 0.97
    assert sum(e["streak"] for e in tail) / 20 > 0.97 * (B - 1)
    pos = [e for e in logs if e["event"] == "train.position_acc"]
    assert len(pos) == 3 and len(pos[-1]["acc_by_position"]) == B - 1

    model = DFlashDraft(DrafterConfig.from_target(heads.spec, 2, len(LAYERS)))
    model.load_state_dict(state.model.state_dict())
    fresh = rule_batch(heads.spec, LAYERS, seed=10_000, n_seqs=8)  # never trained on
    hits = total = 0
    for s in range(8):
        ids = fresh.input_ids[40 * s : 40 * (s + 1)]
        feats = fresh.hidden[40 * s : 40 * (s + 1)]
        for a in (7, 15, 23, 36):
            drafted = _draft_like_an_engine(model, heads, ids, feats, a)
            hits += sum(int(d == int(t)) for d, t in zip(drafted, ids[a + 1 : a + B]))
            total += B - 1
    assert hits / total > 0.95, f"engine-style drafts right {hits}/{total}"
