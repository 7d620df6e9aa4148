"""dflash-export: a training checkpoint becomes a folder in the layout of the drafters the
DFlash authors publish, and our loader reads it back to the very same logits."""

import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors import safe_open
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, rule_batch
from dflash.consumers.drafter.blocks import build_layout
from dflash.consumers.export.export import ExportError, export_checkpoint, load_exported
from dflash.consumers.export.export_command import main
from dflash.consumers.training.train import train
from dflash.consumers.training.config import TrainConfig

pytestmark = pytest.mark.unit

LAYERS = [1, 2]
DRAFT_LAYERS = 5  # the paper's drafter depth: 5 layers -> 58 tensors, as published

# The published layout, written out by hand from the configs the DFlash authors ship
# (z-lab/Qwen3-4B-DFlash-b16 and -8B-, mirrored in SpecForge configs/qwen3-8b-dflash.json;
# docs/EXPORT.md names the commits). Not their code: the key set and the tensor names.
PUBLISHED_CONFIG_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "auto_map", "block_size", "bos_token_id",
    "dflash_config", "dtype", "eos_token_id", "head_dim", "hidden_act", "hidden_size", "initializer_range",
    "intermediate_size", "layer_types", "max_position_embeddings", "max_window_layers", "model_type",
    "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "num_target_layers", "rms_norm_eps",
    "rope_scaling", "rope_theta", "sliding_window", "tie_word_embeddings", "transformers_version", "use_cache",
    "use_sliding_window", "vocab_size",
}
PUBLISHED_DFLASH_CONFIG_KEYS = {"mask_token_id", "target_layer_ids"}
PER_LAYER = ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
             "mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
             "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
             "self_attn.k_norm.weight"]


def published_shapes(D, n_feat, heads, kv_heads, hd, inter, layers):
    """tensor name -> shape, as in the published safetensors headers."""
    out = {"fc.weight": [D, n_feat * D], "hidden_norm.weight": [D], "norm.weight": [D]}
    for i in range(layers):
        p = f"layers.{i}."
        shapes = [[D], [D], [inter, D], [inter, D], [D, inter], [heads * hd, D], [kv_heads * hd, D],
                  [kv_heads * hd, D], [D, heads * hd], [hd], [hd]]
        out.update({p + name: s for name, s in zip(PER_LAYER, shapes)})
    return out


@pytest.fixture(scope="module")
def checkpoint(heads, tmp_path_factory):
    """A real checkpoint written by the training loop (a few steps: norms and weights moved
    off their initial values, so a swapped or dropped tensor changes the logits)."""
    cfg = TrainConfig(draft_layers=DRAFT_LAYERS, target_layers=tuple(LAYERS), block_size=4, anchors=6,
                      mask_token_id=MASK_ID, lr=2e-2, log_position_every=0, save_every=0)
    root = tmp_path_factory.mktemp("run") / "checkpoints"
    with capture_logs():
        state = train(cfg, heads, (rule_batch(heads.spec, LAYERS, seed=i) for i in range(4)), ckpt_root=root)
    return state.last_checkpoint


def _logits(drafter, heads, seed=0, feats=None):
    """Block logits for a fixed random context (or `feats` [T, n*D]) through a loaded drafter, [B, V]."""
    g = torch.Generator().manual_seed(seed)
    B = drafter.block_size
    if feats is None:
        feats = torch.randn(12, len(LAYERS) * heads.spec.hidden_size, generator=g)
    T = feats.shape[0]
    x = F.embedding(torch.tensor([7] + [drafter.mask_token_id] * (B - 1)), heads.embed)
    with torch.no_grad():
        h = drafter.model(feats, x, build_layout([T], [torch.tensor([T])], B, torch.device("cpu")))
    return h @ heads.lm_head.T


def test_export_then_load_gives_the_checkpoints_logits(checkpoint, heads, tmp_path):
    out = export_checkpoint(checkpoint, tmp_path / "export")
    exported = load_exported(out)  # bf16 on disk, loaded into float32
    ours = load_exported(checkpoint)  # a checkpoint is readable as is (same names and keys)
    rounded = load_exported(checkpoint)
    # Training standardised the features (feature_scale, set at step 1); the export folds
    # it into fc.weight, then rounds every tensor to bf16: that is what it must hold, exactly.
    scale = rounded.model.feature_scale
    assert not torch.allclose(scale, torch.ones_like(scale))
    with torch.no_grad():
        rounded.model.fc.weight.mul_(scale[None, :])
        scale.fill_(1.0)
    for p in rounded.model.parameters():
        p.data = p.data.to(torch.bfloat16).float()
    assert torch.equal(exported.model.feature_scale, torch.ones_like(scale))
    assert torch.equal(_logits(exported, heads), _logits(rounded, heads))
    # And the bf16 rounding is all that changed: on context like the one it trained on (the
    # scale makes some columns 8x louder, so off-distribution noise amplifies rounding),
    # logits stay close to the float32 checkpoint's.
    feats = rule_batch(heads.spec, LAYERS, seed=99).hidden[:12]
    torch.testing.assert_close(_logits(exported, heads, feats=feats), _logits(ours, heads, feats=feats),
                               atol=0.05, rtol=0.02)
    assert (exported.block_size, exported.mask_token_id, exported.target_layer_ids) == (4, MASK_ID, LAYERS)
    assert exported.num_target_layers == heads.spec.num_hidden_layers


def test_export_has_the_published_config_keys_and_tensor_names(checkpoint, heads, target_dir, tmp_path):
    out = export_checkpoint(checkpoint, tmp_path / "export", target=target_dir)
    cfg = json.loads((out / "config.json").read_text())
    assert set(cfg) == PUBLISHED_CONFIG_KEYS
    assert set(cfg["dflash_config"]) == PUBLISHED_DFLASH_CONFIG_KEYS
    s = heads.spec
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert cfg["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": LAYERS}  # 0-based decoder layers
    assert cfg["block_size"] == 4 and cfg["num_hidden_layers"] == DRAFT_LAYERS
    assert cfg["num_target_layers"] == s.num_hidden_layers
    assert cfg["layer_types"] == ["full_attention"] * DRAFT_LAYERS
    assert cfg["tie_word_embeddings"] is False and cfg["dtype"] == "bfloat16"
    assert cfg["rope_scaling"] is None and cfg["rope_theta"] == s.rope_theta
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["vocab_size"]) == (s.hidden_size, s.intermediate_size, s.num_attention_heads,
                                                   s.num_key_value_heads, s.head_dim, s.vocab_size)
    target_cfg = json.loads((target_dir / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (target_cfg.get("bos_token_id"), target_cfg.get("eos_token_id"))

    want = published_shapes(s.hidden_size, len(LAYERS), s.num_attention_heads, s.num_key_value_heads, s.head_dim,
                            s.intermediate_size, DRAFT_LAYERS)
    assert len(want) == 58
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}  # transformers refuses safetensors without it
        got = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert got == want and dtypes == {"BF16"}

    # The reference loads it as a plain Qwen3 config carrying the DFlash fields.
    from transformers import Qwen3Config

    qc = Qwen3Config.from_pretrained(out)
    assert qc.block_size == 4 and qc.num_target_layers == s.num_hidden_layers
    assert qc.dflash_config["target_layer_ids"] == LAYERS and qc.num_hidden_layers == DRAFT_LAYERS


def test_cli_exports_resolves_runs_and_refuses_to_overwrite(checkpoint, tmp_path):
    out = tmp_path / "exp"
    r = CliRunner().invoke(main, [str(checkpoint), str(out)])
    assert r.exit_code == 0, r.output
    assert "target_layer_ids [1, 2]" in r.output and (out / "model.safetensors").is_file()
    r = CliRunner().invoke(main, [str(checkpoint), str(out)])
    assert r.exit_code == 2 and "not empty" in r.output
    # A run folder resolves to its newest checkpoint; --force replaces the old export.
    r = CliRunner().invoke(main, [str(checkpoint.parent.parent), str(out), "--force"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, [str(tmp_path / "nothing"), str(tmp_path / "exp2")])
    assert r.exit_code == 2 and "error:" in r.output


def test_loader_refuses_drafters_it_would_run_wrongly(checkpoint, tmp_path):
    out = export_checkpoint(checkpoint, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    (out / "manifest.json").unlink()  # as a hand-edited or published drafter: config.json is checked, not hashed
    bad = [({"layer_types": ["sliding_attention"] * DRAFT_LAYERS}, "full_attention"),
           ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
           ({"dflash_config": {"target_layer_ids": LAYERS}}, "mask_token_id"),
           ({"dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [1, 2, 3]}}, "fc.weight")]
    for change, words in bad:
        (out / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ExportError, match=words):
            load_exported(out)
