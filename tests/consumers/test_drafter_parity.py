"""Issue 17 item 7: for the same context, the drafter's block predictions on the training
path equal those on the speculative-decoding path, logits within fp32 tolerance.

Training path, as a consumer step runs it: a packed two-sequence `Batch` whose features
come from the producer's capture (`Target.capture`), checked by train.py's `_prepare`,
anchors drawn by step.py's `make_layout`, block inputs and forward by `draft_states`,
labels by `BlockLayout.labels`, heads from `load_target_heads`, the loss's argmax by
`block_loss`. Inference path, as dflash-eval runs it: the same weights saved as a
checkpoint, exported by `export_checkpoint`, read back by `load_exported`, driven by
`speculative_greedy` (KV-cached target, features of verified blocks, the drafter's context
K/V cache). A wrapper of `DraftCache.block_states` records each block's input, position and
states; every training block
whose anchor the decoding reached is compared with it. A mask, label, position,
embedding or feature bug between the two paths changes these logits.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from dflash.protocol.batch import Batch
from dflash.consumers.export.export import export_checkpoint, load_exported
from dflash.consumers.drafter.loss import block_loss
from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig, published_config
from dflash.consumers.evaluation.speculative import DraftCache, greedy, speculative_greedy
from dflash.consumers.training.step import draft_states, make_layout
from dflash.runtime.target_heads import load_target_heads
from dflash.consumers.training.train import _prepare
from dflash.consumers.training.train_config import resolve_signal
from dflash.consumers.training.config import TrainConfig
from dflash.producers.target import load_target
from dflash.tools.tiny import MASK_TOKEN, tiny_target

pytestmark = pytest.mark.unit

B, NEW = 8, 28
PROMPTS = ("Count from 3 to 9.", "What is 4 plus 7?")


def _random_drafter(heads, n_features: int) -> DFlashDraft:
    """Large random weights (varied proposals; a wrong input changes them) and random norm
    gains (a swapped or skipped norm shows), rounded to bf16 so the export is lossless."""
    torch.manual_seed(1)
    model = DFlashDraft(DrafterConfig.from_target(heads.spec, 2, n_features))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 if p.dim() > 1 else torch.rand_like(p) + 0.5)
            p.copy_(p.bfloat16().float())
    return model.eval()


def _exported(model: DFlashDraft, heads, cfg_json: dict, target_dir, tmp_path):
    """The model through a checkpoint folder, dflash-export and the export loader."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, ckpt / "model.safetensors")
    (ckpt / "config.json").write_text(json.dumps(cfg_json))
    out = export_checkpoint(ckpt, tmp_path / "export", target=target_dir)
    return load_exported(out, dtype=torch.float32)


@pytest.mark.parametrize("family,tie", [("qwen3", False), ("llama", True)], ids=["qwen3-untied", "llama-tied"])
def test_training_and_speculative_block_logits_are_equal(family, tie, tmp_path):
    from transformers import AutoTokenizer

    path = tiny_target(family=family, tie=tie)
    tok = AutoTokenizer.from_pretrained(path)
    target = load_target(str(path), None, device=torch.device("cpu"), dtype="float32", full=True)
    heads = load_target_heads(path, dtype=torch.float32)
    mask = tok.convert_tokens_to_ids(MASK_TOKEN)
    cfg = TrainConfig(draft_layers=2, target_layers=tuple(target.layer_ids), block_size=B, anchors=64, anchor_every=1,
                      mask_token_id=mask, seed=3)
    signal = resolve_signal(cfg, heads)
    model = _random_drafter(heads, len(signal.target_layers))
    drafter = _exported(model, heads, published_config(model.cfg, heads.spec, block_size=B, mask_token_id=mask,
                                                       target_layer_ids=list(signal.target_layers)), path, tmp_path)
    assert (drafter.block_size, drafter.mask_token_id, drafter.target_layer_ids) == (B, mask, list(signal.target_layers))

    # Inference: record every propose call (context length = anchor position, inputs, output).
    calls: list[dict] = []
    block_states = DraftCache.block_states

    def recorded(self, x, start):
        h = block_states(self, x, start)
        calls.append({"start": int(start), "x": x.clone(), "h": h.clone()})
        return h

    DraftCache.block_states = recorded
    seqs, starts = [], []
    m = target.model
    try:
        for text in PROMPTS:
            prompt = torch.tensor(tok(text)["input_ids"])
            first = len(calls)
            spec = speculative_greedy(m, drafter, prompt, NEW, set())
            assert spec.tokens == greedy(m, prompt, NEW, set()).tokens  # lossless, so the sequence is the target's
            seqs.append(torch.cat([prompt, torch.tensor(spec.tokens)]))
            starts.append(prompt.numel())
            for c in calls[first:]:
                c["seq"] = len(seqs) - 1
    finally:
        DraftCache.block_states = block_states
    W = m.get_output_embeddings().weight

    # Training: the two sequences packed as a producer sends them, responses under the loss mask.
    lens = [s.numel() for s in seqs]
    ids = torch.cat(seqs)
    loss_mask = torch.cat([(torch.arange(L) >= P).to(torch.uint8) for L, P in zip(lens, starts)])
    pos = torch.cat([torch.arange(L) for L in lens])
    hidden = target.capture(ids, pos).float()  # [T, n*D]
    batch, bad = _prepare(Batch.packed([0, 1], lens, ids.to(torch.int32), loss_mask, hidden, batch_id="b0",
                                       layer_ids=target.layer_ids), heads, signal)
    assert bad is None
    layout = make_layout(batch, signal, cfg.seed, torch.device("cpu"), "sdpa")
    with torch.no_grad():
        h = draft_states(model, heads, batch, layout, signal)  # [Q, D]
        x_train = torch.nn.functional.embedding(layout.block_input_ids(batch.input_ids, mask), heads.embed)
    logits_train = (h @ heads.lm_head.T).view(-1, B, heads.lm_head.shape[0])  # [blocks, B, V]
    labels, valid = layout.labels(batch.input_ids, batch.loss_mask)
    _, stats = block_loss(h, heads.lm_head, labels, valid, B, signal.gamma)

    by_anchor = {(c["seq"], c["start"]): c for c in calls}
    compared = correct_inf = 0
    ctx_start = 0
    blk = 0
    for s, (L, a_s) in enumerate(zip(lens, layout.anchors)):
        for a in a_s.tolist():
            c = by_anchor.get((s, a))
            if c is not None:  # the decoding reached this anchor as a bonus (not inside an accepted run)
                assert c["h"].shape[0] == B
                # The same block input and the same logits (the drafter's cache holds the context
                # K/V of tokens 0..a-1 only; equal logits over it are what matters).
                torch.testing.assert_close(c["x"], x_train[blk * B : (blk + 1) * B], atol=0, rtol=0)
                logits_inf = c["h"] @ W.T
                torch.testing.assert_close(logits_inf[1:], logits_train[blk, 1:], atol=1e-4, rtol=1e-4)
                # Position k's label is the token the verification compares draft k against.
                block_labels = labels[blk * B : (blk + 1) * B]
                assert block_labels[1:].tolist() == seqs[s][a + 1 : a + B].tolist()
                correct_inf += int((logits_inf[1:].argmax(-1) == block_labels[1:]).sum())
                compared += 1
            blk += 1
        ctx_start += L
    # A random drafter accepts almost nothing, so the decoding visits every anchor as a bonus:
    # all training blocks were compared, and the loss's argmax agrees with the decoding's drafts.
    assert compared == layout.num_blocks > 2 * (NEW - 2 * B), f"{compared} of {layout.num_blocks} blocks compared"
    assert stats.correct == correct_inf
    # Not vacuous: different anchors give clearly different logits.
    assert (logits_train[0, 1:] - logits_train[1, 1:]).abs().max() > 1e-2
