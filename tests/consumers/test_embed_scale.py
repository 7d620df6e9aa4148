"""The drafter's block input is what the target's own embedding module gives (issue 22,
item 3). Gemma 2/3 multiply every row by sqrt(hidden) in `embed_tokens`; the DFlash
reference inference and the serving engines call `target.model.embed_tokens(ids)`, so a
drafter trained on raw rows would disagree with every engine that serves it.

The inference side here is written as the reference's loop does it: the block
[anchor, MASK...] through `target.model.embed_tokens`, the drafter conditioned on the
features of the tokens before the anchor, logits through `target.lm_head`."""

import math

import pytest
import torch

from dflash.protocol.batch import Batch
from dflash.consumers.drafter.blocks import build_layout
from dflash.protocol.training_signal import Signal
from dflash.consumers.export.export import Drafter
from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig
from dflash.consumers.evaluation.speculative import propose
from dflash.consumers.training.step import draft_states
from dflash.runtime.target_heads import embed_block, load_target_heads
from tests.harness.families import HIDDEN, VOCAB, family_target

pytestmark = pytest.mark.unit

B, LAYERS, MASK = 6, [0, 1, 2], VOCAB - 1


@pytest.fixture(scope="module", params=["gemma3_text", "gemma2"])
def gemma(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = family_target(tmp_path_factory.mktemp(request.param), request.param)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    heads = load_target_heads(folder, dtype=torch.float32)
    torch.manual_seed(1)
    drafter = DFlashDraft(DrafterConfig.from_target(heads.spec, 2, len(LAYERS))).eval()
    for p in drafter.parameters():  # large random weights: a wrong input changes the proposals
        if p.dim() > 1:
            p.data.normal_(0, 0.3)
    return target, heads, drafter


def test_the_recorded_scale_is_the_embedding_modules(gemma):
    target, heads, _ = gemma
    assert heads.embed_scale == pytest.approx(math.sqrt(HIDDEN))
    ids = torch.tensor([3, 0, MASK, 17, MASK])
    with torch.no_grad():
        want = target.model.embed_tokens(ids)
    assert not torch.allclose(want, heads.embed[ids])  # a raw row is not what the model is fed
    torch.testing.assert_close(heads.embed_ids(ids), want, rtol=0, atol=0)
    torch.testing.assert_close(embed_block(ids, target.get_input_embeddings()), want, rtol=0, atol=0)


def test_training_logits_equal_the_reference_inference_paths(gemma):
    target, heads, drafter = gemma
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(3, VOCAB - 2, (30,), generator=g)
    with torch.no_grad():
        out = target(input_ids=seq[None], output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1)  # [L, n*D], the capture
    signal = Signal(anchors=4, block_size=B, target_layers=tuple(LAYERS), gamma=4.0, draft_layers=2,
                    mask_token_id=MASK, target=heads.identity)
    batch = Batch.packed([0], [seq.numel()], seq.to(torch.int32), torch.ones(seq.numel(), dtype=torch.uint8), feats,
                         batch_id="b0", layer_ids=LAYERS)
    exported = Drafter(drafter, B, MASK, LAYERS, heads.spec.num_hidden_layers, {})
    for a in (5, 14, 23):
        layout = build_layout([seq.numel()], [torch.tensor([a])], B, torch.device("cpu"))
        with torch.no_grad():
            trained = draft_states(drafter, heads, batch, layout, signal) @ heads.lm_head.T  # [B, V]
            # The reference's inference: context strictly before the anchor, the block embedded
            # by the target's embed_tokens, logits by its lm_head.
            block = torch.tensor([int(seq[a])] + [MASK] * (B - 1))
            noise_embedding = target.model.embed_tokens(block)
            ctx_layout = build_layout([a], [torch.tensor([a])], B, torch.device("cpu"))
            reference = target.lm_head(drafter(feats[:a], noise_embedding, ctx_layout))
            engine = propose(exported, target.get_input_embeddings(), target.lm_head.weight, feats[:a],
                             int(seq[a]), B)
        torch.testing.assert_close(trained, reference, rtol=1e-4, atol=1e-4, msg=f"anchor {a}")
        assert engine == reference[1:].argmax(-1).tolist() == trained[1:].argmax(-1).tolist(), f"anchor {a}"
