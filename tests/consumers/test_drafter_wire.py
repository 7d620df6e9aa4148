"""Batches as they arrive from the broker: decoded by the codec, read-only, bf16 or fp8."""

import torch
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, batch_message, random_batch
from dflash.consumers.training.config import TrainConfig
from dflash.consumers.training.train import train
from dflash.consumers.training.train_config import Hooks
import pytest

pytestmark = pytest.mark.unit

LAYERS = [1, 2]


def test_decoded_messages_train_directly_and_fill_the_heartbeat_stats(heads):
    src = [random_batch(heads.spec, LAYERS, [20, 14], seed=i, batch_id=f"p1-{i}", sample_start=2 * i)
           for i in range(4)]
    msgs = [batch_message(b, fp8=i % 2 == 1) for i, b in enumerate(src)]
    first = msgs[0].owned(torch.float32)
    first.hidden.add_(1.0)  # a copy: writable, and the frame is untouched
    assert torch.equal(msgs[0].tensors["hidden"].float(), src[0].hidden.to(torch.bfloat16).float())
    fp8 = msgs[1].owned(torch.float32)
    assert torch.allclose(fp8.hidden, src[1].hidden, rtol=0.07, atol=0.05)

    acked, stats = [], {}
    cfg = TrainConfig(draft_layers=2, target_layers=tuple(LAYERS), block_size=4, anchors=4, mask_token_id=MASK_ID,
                      log_position_every=0)
    with capture_logs():
        state = train(cfg, heads, iter(msgs), hooks=Hooks(on_step=lambda s, ids: acked.append((s, ids)), stats=stats))
    assert state.step == 4 and acked == [(i + 1, [f"p1-{i}"]) for i in range(4)]
    assert stats["step"] == 4 and stats["loss"] > 0 and set(stats) >= {"acc", "streak", "tokens_per_s"}
