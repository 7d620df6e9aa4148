"""A consumer reads any family's shapes and vocabulary tensors through transformers' own
config classes and model names (issue 22, item 5): GPT-2 (n_embd, transformer.wte, tied),
GPT-NeoX (embed_in, its LM head saved as embed_out), Falcon (word_embeddings,
ffn_hidden_size), and trains a drafter shaped from them."""

import pytest
import torch
from safetensors import safe_open

from tests.harness.tiny import random_batch
from dflash.protocol.training_signal import Signal
from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig
from dflash.consumers.training.step import batch_loss
from dflash.runtime.target_heads import TargetLoadError, identity_of, load_target_heads
from tests.harness.families import HEADS, HIDDEN, LAYERS, VOCAB, family_target

pytestmark = pytest.mark.unit

FAMILIES = [("gpt2", None), ("gpt_neox", None), ("falcon", None), ("gpt2", False), ("gpt_neox", True)]


@pytest.fixture(scope="module", params=FAMILIES, ids=[f"{f}-{'default' if t is None else 'tied' if t else 'untied'}"
                                                        for f, t in FAMILIES])
def family(request, tmp_path_factory):
    fam, tie = request.param
    return fam, family_target(tmp_path_factory.mktemp(fam), fam, tie)


def test_heads_are_the_models_own_embedding_and_lm_head(family):
    from transformers import AutoModelForCausalLM

    _fam, folder = family
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    heads = load_target_heads(folder)
    assert (heads.spec.hidden_size, heads.spec.num_attention_heads, heads.spec.num_hidden_layers,
            heads.spec.vocab_size) == (HIDDEN, HEADS, LAYERS, VOCAB)
    assert heads.spec.head_dim == HIDDEN // HEADS and heads.spec.intermediate_size > 0
    torch.testing.assert_close(heads.embed, model.get_input_embeddings().weight, rtol=0, atol=0)
    torch.testing.assert_close(heads.lm_head, model.get_output_embeddings().weight, rtol=0, atol=0)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert heads.spec.tie_word_embeddings == tied and (heads.lm_head is heads.embed) == tied
    assert heads.embed_scale == 1.0  # a plain lookup in all three
    assert identity_of(folder) == heads.identity


def test_a_drafter_shaped_from_the_family_trains_on_its_heads(family):
    _fam, folder = family
    heads = load_target_heads(folder)
    layers = [1, 2]
    signal = Signal(anchors=4, block_size=4, target_layers=tuple(layers), gamma=4.0, draft_layers=1,
                    mask_token_id=VOCAB - 1, target=heads.identity)
    torch.manual_seed(0)
    model = DFlashDraft(DrafterConfig.from_target(heads.spec, 1, len(layers)))
    batch = random_batch(heads.spec, layers, [20, 14], seed=0)
    batch.input_ids.clamp_(max=VOCAB - 2)
    loss, stats = batch_loss(model, heads, batch, signal, seed=0)
    loss.backward()
    assert torch.isfinite(loss) and stats.valid > 0
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_gpt_neox_head_is_read_from_its_checkpoint_name(tmp_path):
    """The file keeps `embed_out.weight`; transformers renames it to lm_head on load."""
    folder = family_target(tmp_path / "neox", "gpt_neox")
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "embed_out.weight" in keys and "lm_head.weight" not in keys
    heads = load_target_heads(folder)
    with safe_open(folder / "model.safetensors", "pt") as f:
        torch.testing.assert_close(heads.lm_head, f.get_tensor("embed_out.weight"), rtol=0, atol=0)
    (folder / "model.safetensors").unlink()
    with pytest.raises(TargetLoadError, match="no \\*.safetensors"):
        load_target_heads(folder)


def test_a_config_without_a_shape_field_is_refused_naming_it(tmp_path):
    """A config class would fill a missing field with its default: a drafter of the wrong shape."""
    import json

    folder = family_target(tmp_path / "gpt2", "gpt2")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["n_head"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TargetLoadError, match="lacks 'num_attention_heads' \\(or 'n_head'\\)"):
        load_target_heads(folder)
