"""--draft-init: the draft layers start as exact copies of the target's first or last decoder layers
(Qwen3 with its q/k norms, Llama without: ours stay ones), read from single-file, sharded and GGUF
targets; random is the seeded init as before; a target of too few layers is refused by name."""

import os
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, rule_batch, tiny_target
from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig
from dflash.consumers.parallel.dist import Dist
from dflash.consumers.training.config import TrainConfig
from dflash.consumers.training.train import Trainer, train
from dflash.consumers.training.train_config import Hooks
from dflash.runtime.target_heads import load_target_heads
from dflash.runtime.target_layers import load_target_layers

pytestmark = pytest.mark.unit

LAYERS = [1, 2]
CFG = TrainConfig(draft_layers=2, target_layers=tuple(LAYERS), block_size=4, anchors=6, mask_token_id=MASK_ID,
                  log_position_every=0, save_every=0, seed=3)
QK_NORMS = {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}


def _llama_target(path):
    """A tiny tied Llama of the tiny Qwen3's shapes, saved as real checkpoints are (no q/k norms)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.5)
    torch.manual_seed(1)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["qwen3", "qwen3-sharded", "llama"])
def target(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return _llama_target(path)
    return tiny_target(path, **({"max_shard_size": "50KB"} if request.param == "qwen3-sharded" else {}))


def _target_layers(path) -> dict[str, torch.Tensor]:
    """Every decoder-layer tensor of the target as transformers loads it, by its name in the model."""
    from transformers import AutoModelForCausalLM

    return {k: v for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items() if ".layers." in k}


def _model(cfg, heads):
    with capture_logs() as logs:
        trainer = Trainer(cfg, heads, Dist(), Hooks(), None, None)
    return trainer.model, [e for e in logs if e["event"] == "train.draft_init"]


@pytest.mark.parametrize("mode", ["first", "last"])
def test_each_draft_layer_is_its_target_layer_and_the_rest_is_the_seeded_init(target, mode):
    heads = load_target_heads(target, dtype=torch.float32)
    model, [event] = _model(replace(CFG, draft_init=mode), heads)
    ids = [0, 1] if mode == "first" else [2, 3]
    qwen = heads.spec.model_type == "qwen3"
    assert (event["mode"], event["target_layers"], event["kept"]) == (mode, ids, [] if qwen else sorted(QK_NORMS))
    theirs = _target_layers(target)
    for j, i in enumerate(ids):
        for name, p in model.layers[j].named_parameters():
            if name in QK_NORMS and not qwen:
                assert torch.equal(p, torch.ones_like(p)), name
            else:
                assert torch.equal(p, theirs[f"model.layers.{i}.{name}"]), (j, i, name)
    torch.manual_seed(CFG.seed)  # fc, hidden_norm and the final norm: as a random start draws them
    seeded = DFlashDraft(DrafterConfig.from_target(heads.spec, 2, len(LAYERS))).state_dict()
    for name, t in model.state_dict().items():
        if not name.startswith("layers."):
            assert torch.equal(t, seeded[name]), name


def test_random_is_the_seeded_init(heads):
    model, events = _model(CFG, heads)  # draft_init defaults to random
    torch.manual_seed(CFG.seed)
    seeded = DFlashDraft(DrafterConfig.from_target(heads.spec, 2, len(LAYERS))).state_dict()
    assert not events and model.state_dict().keys() == seeded.keys()
    assert all(torch.equal(t, seeded[k]) for k, t in model.state_dict().items())


def test_a_run_from_the_last_layers_trains_and_says_which_it_copied(heads, tmp_path):
    cfg = replace(CFG, draft_init="last", lr=2e-2, max_steps=3)
    with capture_logs() as logs:
        state = train(cfg, heads, (rule_batch(heads.spec, LAYERS, seed=i) for i in range(3)),
                      ckpt_root=tmp_path / "checkpoints")
    events = [e["event"] for e in logs]
    assert state.step == 3 and events.index("train.draft_init") < events.index("train.start")
    [init] = [e for e in logs if e["event"] == "train.draft_init"]
    assert init["target_layers"] == [2, 3] and init["target_layer_count"] == 4
    assert all(torch.isfinite(p).all() for p in state.model.parameters())


def test_a_resume_takes_the_checkpoints_weights(heads, tmp_path):
    with capture_logs():
        first = train(replace(CFG, max_steps=2), heads, (rule_batch(heads.spec, LAYERS, seed=i) for i in range(2)),
                      ckpt_root=tmp_path / "a")
        trainer = Trainer(replace(CFG, draft_init="last", resume=str(first.last_checkpoint)), heads, Dist(),
                          Hooks(), tmp_path / "b", None)
        copied = trainer.model.layers[0].self_attn.q_proj.weight.clone()
        trainer.join_or_resume(None)
    assert torch.equal(copied, load_target_layers(heads.path, [2])[2]["self_attn.q_proj.weight"])
    saved = first.model.state_dict()
    assert all(torch.equal(t, saved[k]) for k, t in trainer.model.state_dict().items())


def test_a_target_of_fewer_layers_than_the_drafter_is_refused(heads, target_dir, tmp_path):
    with pytest.raises(ValueError, match="the target has 4 decoder layers, fewer than --draft-layers 5"):
        train(replace(CFG, draft_layers=5, draft_init="first"), heads, iter(()), ckpt_root=tmp_path)
    from dflash.consumers.process.consume_command import main

    r = CliRunner().invoke(main, ["--target", str(target_dir), "--runs-dir", str(tmp_path / "runs"),
                                  "--draft-layers", "5", "--draft-init", "last", "--mask-token-id", str(MASK_ID),
                                  "--synthetic-batches", "1", "--instance", "test-cpu"])
    assert r.exit_code == 2 and "the target has 4 decoder layers, fewer than --draft-layers 5" in r.output


def test_a_missing_layer_and_another_layer_layout_are_refused(target_dir, tmp_path):
    from dflash.consumers.drafter.model import copy_target_layers
    from dflash.runtime.target_heads import TargetLoadError

    with pytest.raises(TargetLoadError, match="has no decoder layer 4"):
        load_target_layers(target_dir, [3, 4])
    heads = load_target_heads(target_dir, dtype=torch.float32)
    model = DFlashDraft(DrafterConfig.from_target(heads.spec, 1, len(LAYERS)))
    layers = load_target_layers(target_dir, [3])
    with pytest.raises(ValueError, match="activation is gelu"):
        copy_target_layers(model, layers, "gelu")
    layers[3]["self_attn.q_proj.bias"] = torch.zeros(64)
    with pytest.raises(ValueError, match="has self_attn.q_proj.bias beyond a draft layer"):
        copy_target_layers(model, layers, "silu")


# ---------------------------------------------------------------- a GGUF target (the real one)

LONG = os.environ.get("DFLASH_LONG") == "1"


@pytest.mark.real_target
def test_a_gguf_targets_layers_come_from_its_converted_folder(monkeypatch):
    from dflash.runtime import targets
    from dflash.tools import real_target

    folder, gguf = real_target.hf_folder(), real_target.fetch_gguf()
    assert targets.converted_folder(gguf) == folder
    monkeypatch.setattr(targets, "load_causal_lm", lambda *a, **k: pytest.fail("the whole model was loaded"))
    got, want = load_target_layers(gguf, [28, 29]), load_target_layers(folder, [28, 29])
    assert got.keys() == want.keys() == {28, 29}
    assert all(torch.equal(t, want[i][n]) for i in got for n, t in got[i].items())
    assert not QK_NORMS & set(got[28])  # Llama


@pytest.mark.real_target
@pytest.mark.skipif(not LONG, reason="DFLASH_LONG=1: transformers de-quantises the whole GGUF file (~1 min of CPU)")
@pytest.mark.parametrize("cache", ["empty", "off"])
def test_a_gguf_target_without_a_converted_folder_gives_the_folders_layers(cache, monkeypatch, tmp_path):
    """Converted on the spot into the cache (as the producer's first load would), or, with the cache
    off, de-quantised whole by transformers: the same tensors either way."""
    from dflash.runtime import targets
    from dflash.tools import real_target

    folder, gguf = real_target.hf_folder(), real_target.fetch_gguf()
    monkeypatch.setenv("DFLASH_GGUF_CACHE", "off" if cache == "off" else str(tmp_path))
    got, want = load_target_layers(gguf, [29]), load_target_layers(folder, [29])
    assert got[29].keys() == want[29].keys()
    assert all(torch.equal(t, want[29][n]) for n, t in got[29].items())
    assert (targets.converted_folder(gguf) is None) == (cache == "off")
