"""consumers/drafter/fused.py: the torch.compile'd elementwise kernels (dflash-consume --fuse) give
the same training step as the eager ones: loss, statistics and gradients to rounding."""

import shutil

import pytest
import torch

from tests.harness.tiny import MASK_ID, random_batch
from dflash.consumers.drafter import fused
from dflash.protocol.training_signal import Signal
from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig
from dflash.consumers.training.step import batch_loss

pytestmark = pytest.mark.unit

LAYERS, B = [1, 2], 4


def _step(heads, batch, seed=0, loss="ce"):
    torch.manual_seed(seed)
    model = DFlashDraft(DrafterConfig.from_target(heads.spec, 2, len(LAYERS)))
    signal = Signal(anchors=6, block_size=B, target_layers=tuple(LAYERS), gamma=4.0, draft_layers=2,
                    mask_token_id=MASK_ID, target=heads.identity, loss=loss,
                    dpace_alpha=0.5 if loss == "dpace" else None)
    loss, stats = batch_loss(model, heads, batch, signal, seed=3, backend="sdpa")
    loss.backward()
    return float(loss), stats, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on CPU needs a C compiler")
@pytest.mark.timeout(600)
def test_fused_step_equals_eager_step(heads):
    batch = random_batch(heads.spec, LAYERS, [30, 17, 25], seed=1)
    eager = _step(heads, batch)
    eager_dpace = _step(heads, batch, loss="dpace")  # the CE chunk with unit weights (w None)
    fused.enable(True)
    try:
        assert fused.enabled()
        got = _step(heads, batch)
        again = _step(heads, random_batch(heads.spec, LAYERS, [12, 40], seed=2))  # other shapes
        got_dpace = _step(heads, batch, loss="dpace")
    finally:
        fused.enable(False)
    assert not fused.enabled()
    for want, have in ((eager, got), (eager_dpace, got_dpace)):
        assert have[0] == pytest.approx(want[0], rel=1e-5)
        assert (have[1].correct, have[1].valid, have[1].blocks) == (want[1].correct, want[1].valid, want[1].blocks)
        for name, g in want[2].items():
            torch.testing.assert_close(have[2][name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert again[0] > 0 and eager_dpace[0] != pytest.approx(eager[0])
