"""Speculative decoding drives the drafter exactly as training taught it, and its output is
the target's greedy output (tied and untied targets); dflash-eval reports and checks that."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from dflash.consumers.drafter.blocks import build_layout
from dflash.consumers.export.export import Drafter, export_checkpoint
from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig, published_config
from dflash.consumers.evaluation.speculative import Generation, _target_step, greedy, propose, speculative_greedy
from dflash.runtime.hf_compat import new_cache
from dflash.runtime.target_heads import TargetSpec
from dflash.producers.target import load_target
from dflash.consumers.evaluation.evaluate import Prompt, prompt_report, summarise
from dflash.tools.eval_command import main
from dflash.tools.tiny import MASK_TOKEN, tiny_target

pytestmark = pytest.mark.unit

B = 8
FAMILIES = [("qwen3", False), ("llama", True)]


def _chat(i):
    return {"messages": [{"role": "user", "content": f"What is {i} plus {i + 3}?"},
                         {"role": "assistant", "content": "ignored"}]}


@pytest.fixture(scope="module", params=FAMILIES, ids=["qwen3-untied", "llama-tied"])
def setup(request):
    """A tiny target (full model, tokenizer) and a drafter with large random weights, so
    it proposes varied tokens and a wrong feature or position would change them."""
    from transformers import AutoTokenizer

    family, tie = request.param
    path = tiny_target(family=family, tie=tie)
    target = load_target(str(path), None, device=torch.device("cpu"), full=True)
    tok = AutoTokenizer.from_pretrained(path)
    spec = TargetSpec.from_config(target.config.to_dict())
    torch.manual_seed(1)
    model = DFlashDraft(DrafterConfig.from_target(spec, 2, len(target.layer_ids)))
    for p in model.parameters():
        if p.dim() > 1:
            p.data.normal_(0, 0.3)
    drafter = Drafter(model.eval(), B, tok.convert_tokens_to_ids(MASK_TOKEN), target.layer_ids,
                      spec.num_hidden_layers, {})
    return path, target, tok, drafter


def test_proposals_equal_the_training_paths_block_predictions(setup):
    _path, target, tok, drafter = setup
    m = target.model
    prompt = torch.tensor(tok("Count from 3 to 9.")["input_ids"])
    seq = torch.cat([prompt, torch.tensor(greedy(m, prompt, 24, set()).tokens)])  # [L]
    # The producer's capture (packed, hooks) and the eval's hidden_states[i + 1] are the same features.
    captured = target.capture(seq, torch.arange(seq.numel())).float()  # [L, n*D]
    with torch.no_grad():
        _, feats = _target_step(m, seq, 0, new_cache(m), target.layer_ids)
    torch.testing.assert_close(feats, captured)
    E, W = m.get_input_embeddings().weight, m.get_output_embeddings().weight
    for a in (prompt.numel(), prompt.numel() + 7, seq.numel() - B):
        # Training: the whole sequence as context, the block mask hides positions >= a.
        layout = build_layout([seq.numel()], [torch.tensor([a])], B, torch.device("cpu"))
        x = F.embedding(layout.block_input_ids(seq, drafter.mask_token_id), E)
        with torch.no_grad():
            trained_view = (drafter.model(captured, x, layout)[1:] @ W.T).argmax(-1).tolist()
            engine_view = propose(drafter, E, W, feats[:a], int(seq[a]), B)  # context before a only
        assert engine_view == trained_view, f"anchor {a}"


def test_speculative_output_is_greedy_output_and_stops_like_it(setup):
    _path, target, tok, drafter = setup
    m = target.model
    for i in range(3):
        prompt = torch.tensor(tok(f"Spell {i} backwards.")["input_ids"])
        base = greedy(m, prompt, 40, set())
        spec = speculative_greedy(m, drafter, prompt, 40, set())
        assert spec.tokens == base.tokens and len(base.tokens) == 40
        assert sum(spec.accept_lengths) == 39  # every token after the prefill's came from a cycle
        assert spec.drafted == sum(min(B, 40 - 1 - sum(spec.accept_lengths[:k])) - 1
                                   for k in range(len(spec.accept_lengths)))
        # A stop token ends both decodings right after it, wherever it falls in a block.
        stop = {base.tokens[17]}
        cut = base.tokens[: base.tokens.index(base.tokens[17]) + 1]
        assert greedy(m, prompt, 40, stop).tokens == cut
        assert speculative_greedy(m, drafter, prompt, 40, stop).tokens == cut


def test_report_names_a_prompt_whose_output_differs():
    same = Generation([5, 6, 7], 0.2)
    rows = [prompt_report(Prompt("a", [1, 2]), same, Generation([5, 6, 7], 0.1, [2, 1], 3, 1), B),
            prompt_report(Prompt("b", [1, 2]), same, Generation([5, 9, 7], 0.1, [3], 2, 2), B)]
    rep = summarise(rows, B)
    assert rep["mismatches"] == ["b"] and rows[1]["first_difference"] == 1
    assert rows[0]["tau"] == 1.5 and rep["tau_hist"][:3] == [1, 1, 1] and rep["tau_pooled"] == 2.0
    assert rep["tau"] == 2.25 and rep["speedup"] == 2.0 and rep["acceptance_rate"] == 0.6


def test_eval_cli_reports_and_checks_every_prompt(setup, tmp_path):
    path, target, tok, drafter = setup
    spec = TargetSpec.from_config(target.config.to_dict())
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in drafter.model.state_dict().items()}, ckpt / "model.safetensors")
    cfg = published_config(drafter.model.cfg, spec, block_size=B, mask_token_id=drafter.mask_token_id,
                           target_layer_ids=drafter.target_layer_ids)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [_chat(1), {"prompt": "Count to 5.", "id": "raw"}, _chat(2)]))
    for drafter_dir in (ckpt, export_checkpoint(ckpt, tmp_path / "export")):
        r = CliRunner().invoke(main, ["--target", str(path), "--drafter", str(drafter_dir), "--prompts", str(prompts),
                                      "--max-new-tokens", "20", "--json"])
        assert r.exit_code == 0, r.output
        rep = json.loads(r.stdout)  # stdout holds only the report
        assert [p["prompt"] for p in rep["per_prompt"]] == ["prompts.jsonl:1", "raw", "prompts.jsonl:3"]
        assert rep["mismatches"] == [] and all(p["lossless"] for p in rep["per_prompt"])
        assert rep["new_tokens"] == 60 and sum(rep["tau_hist"]) == rep["cycles"]
        assert 1.0 <= rep["tau"] <= B and rep["speedup"] > 0
    r = CliRunner().invoke(main, ["--target", str(path), "--drafter", str(ckpt), "--prompts", str(prompts),
                                  "--max-new-tokens", "5"])
    assert r.exit_code == 0 and "overall: tau" in r.output and "lossless" in r.output


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on CPU needs a C compiler")
@pytest.mark.timeout(600)
def test_fused_drafter_drafts_the_same_and_stays_lossless(setup):
    """dflash-eval --fuse: the drafter's norms, RoPE and SwiGLU compiled make the same
    proposals (so the same tau) and the output stays the target's greedy output."""
    from dflash.consumers.drafter import fused
    from dflash.tools.eval import enable_fused

    _path, target, tok, drafter = setup
    m = target.model
    prompt = torch.tensor(tok("Name three colours.")["input_ids"])
    eager = speculative_greedy(m, drafter, prompt, 32, set())
    assert enable_fused("auto", torch.device("cpu")) is False and not fused.enabled()  # auto: GPU only
    try:
        assert enable_fused("on", torch.device("cpu")) is True and fused.enabled()
        got = speculative_greedy(m, drafter, prompt, 32, set())
    finally:
        fused.enable(False)
    assert got.tokens == greedy(m, prompt, 32, set()).tokens == eager.tokens
    assert got.accept_lengths == eager.accept_lengths and got.accepted == eager.accepted
