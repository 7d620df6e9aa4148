"""dflash-eval tells a tie-flip from a bug: in bfloat16 a first difference where the target's
two tokens are within the tie tolerance is counted as a tie-flip, anything else (and any
difference at all in float32) is a mismatch; both counts are reported and only mismatches
fail the command."""

import json

import pytest
import torch
from click.testing import CliRunner

from dflash.consumers.evaluation.speculative import TargetGreedy
from dflash.decoding.ties import TIE_TOLERANCE
from dflash.consumers.evaluation.evaluate import Prompt, prompt_report, resolve_tie_tolerance, summarise
from dflash.tools.eval import format_report
from dflash.tools.eval_command import main
from dflash.tools.families import tiny_model

pytestmark = pytest.mark.unit

B = 4


def _twin_setup():
    """A target whose LM head row `twin` equals that of the token greedy emits at step 3:
    a tie made exact there. A flip at that step is what rounding in a low precision does."""
    model = tiny_model("llama", seed=3)
    prompt = torch.randint(3, 500, (6,), generator=torch.Generator().manual_seed(1)).tolist()
    base = TargetGreedy(model, max_prompt=6, max_new_tokens=8, stop_ids=set())(prompt)
    head = model.get_output_embeddings().weight
    twin = next(t for t in range(3, model.config.vocab_size) if t not in base.tokens)
    head[twin] = head[base.tokens[3]]
    return model, prompt, base, twin


def _spec_like(base, tokens):
    """The speculative side of a report: its tokens as given (figures as a decode reports)."""
    from dflash.consumers.evaluation.speculative import Generation

    return Generation(tokens, base.seconds / 2, [2] * (len(tokens) // 2), len(tokens), len(tokens) // 2)


def test_a_flip_between_tied_tokens_is_a_tie_flip_in_bf16_and_a_mismatch_in_fp32():
    from dflash.decoding.ties import divergence

    model, prompt, base, twin = _twin_setup()
    flipped = base.tokens[:3] + [twin] + base.tokens[4:]
    div = divergence(model, prompt, base.tokens, flipped)
    p = Prompt("tie", prompt)
    bf16 = summarise([prompt_report(p, base, _spec_like(base, flipped), B, div, TIE_TOLERANCE[torch.bfloat16])], B,
                     TIE_TOLERANCE[torch.bfloat16])
    assert bf16["tie_flips"] == ["tie"] and bf16["mismatches"] == []
    row = bf16["per_prompt"][0]
    assert row["first_difference"] == 3 and row["flip_margin"] == pytest.approx(0.0, abs=1e-5)
    assert row["top2_margin"] == pytest.approx(0.0, abs=1e-5)
    assert "1 tie-flip(s) within logit margin 0.5" in format_report(bf16) and "tie-flip at 3" in format_report(bf16)
    fp32 = summarise([prompt_report(p, base, _spec_like(base, flipped), B, div, None)], B, None)
    assert fp32["mismatches"] == ["tie"] and fp32["tie_flips"] == []
    assert "(float32: none allowed)" in format_report(fp32)


def test_a_token_far_from_the_top_is_a_mismatch_whatever_the_precision():
    from dflash.decoding.ties import divergence

    model, prompt, base, _ = _twin_setup()
    logits = model(input_ids=torch.tensor([prompt + base.tokens[:3]])).logits[0, -1]
    wrong = base.tokens[:3] + [int(logits.argmin())] + base.tokens[4:]
    div = divergence(model, prompt, base.tokens, wrong)
    rep = summarise([prompt_report(Prompt("bug", prompt), base, _spec_like(base, wrong), B, div, 0.5)], B, 0.5)
    assert rep["mismatches"] == ["bug"] and rep["tie_flips"] == []
    assert rep["per_prompt"][0]["flip_margin"] > 0.5
    # Stopping early (a shorter output) is never a tie.
    short = summarise([prompt_report(Prompt("short", prompt), base, _spec_like(base, base.tokens[:5]), B,
                                     divergence(model, prompt, base.tokens, base.tokens[:5]), 100.0)], B, 100.0)
    assert short["mismatches"] == ["short"]


def test_tolerance_defaults_per_dtype_and_fp32_refuses_one():
    assert resolve_tie_tolerance(torch.float32, None) is None
    assert resolve_tie_tolerance(torch.bfloat16, None) == TIE_TOLERANCE[torch.bfloat16] > 0
    assert resolve_tie_tolerance(torch.float16, 0.1) == 0.1
    with pytest.raises(ValueError, match="must be exact"):
        resolve_tie_tolerance(torch.float32, 0.5)
    with pytest.raises(ValueError, match=">= 0"):
        resolve_tie_tolerance(torch.bfloat16, -1.0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target folder and a random drafter checkpoint for it."""
    from safetensors.torch import save_file

    from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig, published_config
    from dflash.runtime.target_heads import TargetSpec
    from dflash.tools.tiny import MASK_TOKEN, tiny_target
    from transformers import AutoTokenizer

    path = tiny_target(family="qwen3", tie=False)
    tok = AutoTokenizer.from_pretrained(path)
    spec = TargetSpec.from_config(json.loads((path / "config.json").read_text()))
    torch.manual_seed(1)
    model = DFlashDraft(DrafterConfig.from_target(spec, 1, 2))
    ckpt = tmp_path_factory.mktemp("ckpt")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, ckpt / "model.safetensors")
    cfg = published_config(model.cfg, spec, block_size=B, mask_token_id=tok.convert_tokens_to_ids(MASK_TOKEN),
                           target_layer_ids=[1, 3])
    (ckpt / "config.json").write_text(json.dumps(cfg))
    prompts = ckpt / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Count to {i}."}) for i in range(2)))
    return path, ckpt, prompts


def test_eval_cli_in_bf16_reports_both_counts(pair):
    path, ckpt, prompts = pair
    r = CliRunner().invoke(main, ["--target", str(path), "--drafter", str(ckpt), "--prompts", str(prompts),
                                  "--max-new-tokens", "12", "--dtype", "bfloat16", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["tie_tolerance"] == TIE_TOLERANCE[torch.bfloat16]
    assert rep["mismatches"] == [] and isinstance(rep["tie_flips"], list)
    assert all("tie_flip" in p for p in rep["per_prompt"])
    r = CliRunner().invoke(main, ["--target", str(path), "--drafter", str(ckpt), "--prompts", str(prompts),
                                  "--max-new-tokens", "4", "--tie-tolerance", "0.5"])
    assert r.exit_code != 0 and "must be exact" in r.output
