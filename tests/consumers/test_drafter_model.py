"""The drafter's wiring: Qwen3 fidelity, what each block may see, and the published names."""

import pytest
import torch

from tests.harness.tiny import MASK_ID, random_batch
from dflash.consumers.drafter.blocks import build_layout
from dflash.protocol.training_signal import Signal
from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig
from dflash.consumers.training.step import draft_states

pytestmark = pytest.mark.unit

LAYERS = [1, 2]
B = 4


def _model(heads, n_layers=2, seed=0):
    torch.manual_seed(seed)
    model = DFlashDraft(DrafterConfig.from_target(heads.spec, n_layers, len(LAYERS)))
    # Non-trivial norms, so a wrong norm placement cannot hide behind weights of one.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def _signal(heads):
    return Signal(anchors=8, block_size=B, target_layers=tuple(LAYERS), gamma=4.0, draft_layers=2,
                  mask_token_id=MASK_ID, target=heads.identity)


def test_decoder_layer_is_a_qwen3_layer(heads):
    """With no context and one block, a draft layer is a transformers Qwen3 decoder layer
    with bidirectional attention: same names, same norms, same RoPE, same SwiGLU."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    model = _model(heads)
    ours = model.layers[0]
    hf_cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0)
    hf_cfg._attn_implementation = "sdpa"
    theirs = Qwen3DecoderLayer(hf_cfg, 0).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)  # identical parameter names

    x = torch.randn(6, 64)
    layout = build_layout([0], [torch.tensor([3])], 6, torch.device("cpu"))  # positions 3..8
    rope = model.rotary(layout.q_pos)
    got = ours(x, torch.zeros(0, 64), rope, layout)
    pos = torch.arange(3, 9)[None]
    cos_sin = Qwen3RotaryEmbedding(hf_cfg)(x[None], pos)
    want = theirs(x[None], attention_mask=torch.zeros(1, 1, 6, 6), position_ids=pos, position_embeddings=cos_sin)
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_block_sees_only_context_before_its_anchor_and_itself(heads, backend):
    spec = heads.spec
    batch = random_batch(spec, LAYERS, [20, 16], seed=1)
    anchors = [torch.tensor([5, 9, 14]), torch.tensor([4, 10])]
    model, signal = _model(heads), _signal(heads)

    def logits(b):
        layout = build_layout(b.seq_lens, anchors, B, torch.device("cpu"), backend)
        with torch.no_grad():
            return draft_states(model, heads, b, layout, signal) @ heads.lm_head.T  # [Q, V]

    base = logits(batch)
    blk = slice(B, 2 * B)  # block 1 of sequence 0: anchor 9

    def changed(edit) -> bool:
        b = random_batch(spec, LAYERS, [20, 16], seed=1)
        edit(b)
        return not torch.equal(logits(b)[blk], base[blk])

    def noise(b, rows):
        b.hidden[rows] += 3.0

    assert not changed(lambda b: noise(b, slice(9, 20)))  # context at and after the anchor
    assert not changed(lambda b: noise(b, 9))  # the anchor's own feature
    assert not changed(lambda b: noise(b, slice(20, 36)))  # another sequence
    assert not changed(lambda b: b.input_ids.__setitem__(5, 7))  # another block's anchor token
    assert not changed(lambda b: b.input_ids.__setitem__(14, 7))
    assert not changed(lambda b: b.input_ids.__setitem__(20 + 4, 7))
    assert not changed(lambda b: b.input_ids.__setitem__(10, 7))  # tokens only enter as anchors
    assert changed(lambda b: noise(b, 8))  # the context token right before the anchor
    assert changed(lambda b: noise(b, 0))  # the first token of the sequence
    assert changed(lambda b: b.input_ids.__setitem__(9, 7))  # its own anchor token


def test_flex_and_sdpa_agree_and_packing_does_not_matter(heads):
    spec = heads.spec
    batch = random_batch(spec, LAYERS, [20, 16], seed=2)
    anchors = [torch.tensor([0, 7, 16]), torch.tensor([4, 12])]
    model, signal = _model(heads), _signal(heads)
    with torch.no_grad():
        out = {be: draft_states(model, heads, batch, build_layout(batch.seq_lens, anchors, B, torch.device("cpu"), be),
                                signal) for be in ("sdpa", "flex")}
        alone = random_batch(spec, LAYERS, [20, 16], seed=2).select([1])
        single = draft_states(model, heads, alone, build_layout([16], anchors[1:], B, torch.device("cpu")), signal)
    torch.testing.assert_close(out["flex"], out["sdpa"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["sdpa"][3 * B :], single, rtol=1e-5, atol=1e-5)


def test_parameter_names_match_the_published_layout(heads):
    # feature_scale is training's own (export folds it into fc.weight; test_drafter_export)
    names = set(_model(heads, n_layers=5).state_dict()) - {"feature_scale"}
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                 "input_layernorm", "post_attention_layernorm"]
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    want |= {f"layers.{i}.{p}.weight" for i in range(5) for p in per_layer}
    assert names == want and len(names) == 58  # docs/EXPORT.md: 5 layers -> 58 tensors
    assert _model(heads).state_dict()["fc.weight"].shape == (64, 2 * 64)



def test_flex_pads_the_context_keys_to_a_tile_and_no_query_sees_the_padding(heads):
    """Flex pads the context's key rows to a tile boundary (36 keys -> 128, so that the block keys
    start a tile); SDPA has no padding. Same states. Flex has no backward on CPU: the gradients are
    compared on a GPU by bench/drafter_step.py (`flex_vs_sdpa_grad_rel_err`)."""
    batch = random_batch(heads.spec, LAYERS, [20, 16], seed=4)
    anchors = [torch.tensor([0, 5, 9]), torch.tensor([2, 8])]
    signal = _signal(heads)
    outs = {}
    for be in ("sdpa", "flex"):
        layout = build_layout(batch.seq_lens, anchors, B, torch.device("cpu"), be)
        assert layout.key_pad == (128 - 36 if be == "flex" else 0)
        assert layout.key_positions().shape[0] == layout.context_keys + layout.num_queries
        with torch.no_grad():
            outs[be] = draft_states(_model(heads, seed=1), heads, batch, layout, signal)
    torch.testing.assert_close(outs["flex"], outs["sdpa"], rtol=1e-5, atol=1e-5)
