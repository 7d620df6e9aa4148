"""Checkpoints: resume continues exactly, a different training signal is refused."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, random_batch
from dflash.consumers.checkpoints.checkpoint import resolve_checkpoint
from dflash.protocol.training_signal import SignalMismatch
from dflash.consumers.training.train import train
from dflash.consumers.training.train_config import Hooks
from dflash.consumers.training.config import TrainConfig
from dflash.runtime.run import make_run_dir, new_run_id

pytestmark = pytest.mark.unit

LAYERS = [1, 2]
CFG = TrainConfig(draft_layers=2, target_layers=tuple(LAYERS), block_size=4, anchors=6, mask_token_id=MASK_ID,
                  lr=2e-3, total_steps=20, save_every=10, keep=3, feature_noise=0.05, log_position_every=0)


def _batches(spec, lo, hi):
    # Packing varies from batch to batch, as a producer's token budget makes it.
    return [random_batch(spec, LAYERS, [24, 17, 30][: 1 + i % 3], seed=i, batch_id=f"b{i}", sample_start=10 * i)
            for i in range(lo, hi)]


def test_resume_from_step_10_equals_the_uninterrupted_run(heads, tmp_path):
    run_a, run_b = new_run_id(1_700_000_000), new_run_id(1_700_000_100)
    ckpt_a = make_run_dir(run_a, tmp_path) / "checkpoints"
    committed, acked = [], []
    hooks = Hooks(on_step=lambda s, ids: acked.append((s, ids)), on_checkpoint=lambda s, p: committed.append((s, p)))
    with capture_logs():
        full = train(CFG, heads, _batches(heads.spec, 0, 20), ckpt_root=ckpt_a, hooks=hooks)
    assert [s for s, _ in committed] == [10, 20] and acked[3] == (4, ["b3"])

    step10 = ckpt_a / "step-10"
    assert resolve_checkpoint("latest", tmp_path) == ckpt_a / "step-20"
    assert resolve_checkpoint(run_a, tmp_path) == ckpt_a / "step-20"
    ckpt_b = make_run_dir(run_b, tmp_path) / "checkpoints"
    with capture_logs():
        resumed = train(replace(CFG, resume=str(step10)), heads, _batches(heads.spec, 10, 20), ckpt_root=ckpt_b)
    assert resumed.step == 20 and resumed.tokens == full.tokens and resumed.samples == full.samples
    after = resumed.model.state_dict()
    for name, p in full.model.state_dict().items():
        assert torch.equal(p, after[name]), name
    # `latest` now means the resumed run's newest checkpoint
    assert resolve_checkpoint("latest", tmp_path) == ckpt_b / "step-20"


def test_checkpoint_folder_holds_everything_and_keeps_the_last_n(heads, tmp_path):
    root = tmp_path / "checkpoints"
    with capture_logs():
        train(replace(CFG, save_every=5, keep=2, total_steps=12, max_steps=12), heads,
              _batches(heads.spec, 0, 20), ckpt_root=root)
    assert sorted(p.name for p in root.iterdir()) == ["step-10", "step-12"]  # 5 pruned, final 12 written
    ck = root / "step-12"
    assert sorted(p.name for p in ck.iterdir()) == ["config.json", "manifest.json", "model.safetensors", "optimizer.pt",
                                                     "rng.pt", "state.json", "trained.safetensors"]
    state = json.loads((ck / "state.json").read_text())
    assert state["step"] == 12 and state["tokens"] > 0
    assert state["signal"] == {"anchors": 6, "block_size": 4, "target_layers": LAYERS, "gamma": 2.5,
                               "draft_layers": 2, "mask_token_id": MASK_ID, "target": heads.identity,
                               "distill": 0.0, "anchor_every": 1, "loss": "ce", "dpace_alpha": None,
                               "mask_choice": {"token_id": MASK_ID, "token": None, "rule": "explicit",
                                               "reason": "--mask-token-id", "warnings": []}}
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert cfg["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": LAYERS}
    assert cfg["num_target_layers"] == 4 and cfg["num_hidden_layers"] == 2
    weights = load_file(ck / "model.safetensors")
    assert "fc.weight" in weights and not any("embed" in k or "lm_head" in k for k in weights)


def test_resume_with_another_block_size_is_refused_unless_forced(heads, tmp_path):
    root = tmp_path / "checkpoints"
    with capture_logs():
        train(replace(CFG, max_steps=3), heads, _batches(heads.spec, 0, 3), ckpt_root=root)
    ck = str(root / "step-3")
    with pytest.raises(SignalMismatch, match=r"block_size: 4 -> 8") as e:
        train(replace(CFG, block_size=8, resume=ck), heads, _batches(heads.spec, 3, 5))
    assert "gamma" in str(e.value) and "anchors" not in str(e.value)
    with pytest.raises(SignalMismatch, match="anchors: 6 -> 7"):
        train(replace(CFG, anchors=7, resume=ck), heads, _batches(heads.spec, 3, 5))
    with pytest.raises(SignalMismatch, match="anchor_every: 1 -> 3"):
        train(replace(CFG, anchor_every=3, resume=ck), heads, _batches(heads.spec, 3, 5))
    with capture_logs() as logs:
        state = train(replace(CFG, block_size=8, resume=ck, force=True), heads, _batches(heads.spec, 3, 5))
    assert state.step == 5
    assert any(e["event"] == "train.signal_changed" for e in logs)


def test_a_joiner_whose_checkpoint_was_pruned_after_the_stream_ended_trains_nothing(tmp_path):
    """The chaos run's late joiner: welcomed with the newest commit's checkpoint, which rank
    0 pruned before the joiner loaded it, while the broker already said end of stream.
    Nothing is left to train, so it ends cleanly; before the end, the same error stands."""
    import threading
    from types import SimpleNamespace

    from dflash.consumers.process.broker_hooks import nothing_left_to_train

    gone = tmp_path / "runs" / "r" / "checkpoints" / "step-140"
    with pytest.raises(FileNotFoundError) as err:
        resolve_checkpoint(str(gone), tmp_path / "runs")
    ended = SimpleNamespace(stopped=threading.Event(), stop_reason="end_of_stream")
    ended.stopped.set()
    with capture_logs() as logs:
        state = nothing_left_to_train(ended, err.value)
    assert (state.step, state.end_reason, state.model) == (0, "end_of_stream", None)
    assert [e["event"] for e in logs] == ["consume.nothing_to_train"]
    running = SimpleNamespace(stopped=threading.Event(), stop_reason=None)
    for link in (running, SimpleNamespace(stopped=ended.stopped, stop_reason="shutdown")):
        with pytest.raises(FileNotFoundError):
            nothing_left_to_train(link, err.value)
