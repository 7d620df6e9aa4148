"""The must-show of issue 9 on the tiny local setup: a drafter trained on target-regenerated
chats has a real acceptance length (dflash-eval's speculative decoding, held-out prompts)
clearly above 1 and above the untrained drafter's, and every output equals the target's
greedy output. Regeneration, capture and training are the project's own code, in-process.

Random tiny targets are repetitive talkers, each in its own way: the tied Llama falls into
one-token loops within a few tokens, the untied Qwen3 into longer, prompt-dependent ones;
the bars below are set by what each can show (docs/EVAL.md has the figures).
Short form by default; DFLASH_LONG=1 trains on more chats and evaluates more prompts.
"""

import os
from dataclasses import dataclass

import pytest
import torch
from structlog.testing import capture_logs

from dflash.consumers.export.export import Drafter
from dflash.consumers.drafter.model import DFlashDraft
from dflash.runtime.target_heads import load_target_heads
from dflash.consumers.training.train import train
from dflash.consumers.training.config import TrainConfig
from dflash.producers.target import load_target
from dflash.consumers.evaluation.evaluate import Prompt, evaluate, prompt_ids, stop_ids
from dflash.tools.tiny import MASK_TOKEN, tiny_target
from tests.consumers.eval_helpers import epochs, regenerated_batches, sample_chats

pytestmark = pytest.mark.unit

LONG = os.environ.get("DFLASH_LONG") == "1"
B, NEW_TOKENS = 8, (48 if LONG else 32)


@dataclass
class Case:
    family: str
    tie: bool
    epochs: int
    min_tau: float  # what the trained drafter must reach on held-out prompts (untrained: 1.0)


# Seen with token-ID regeneration: short form llama 7.6, qwen3 1.39; long form qwen3 1.56
# (text regeneration gave qwen3 1.12 short, 1.61 long; docs/EVAL.md).
CASES = [Case("llama", True, 30, 3.0), Case("qwen3", False, 40, 1.2)]


@pytest.mark.slow
@pytest.mark.timeout(900 if LONG else 300)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.family}-{'tied' if c.tie else 'untied'}")
def test_trained_drafter_accepts_more_and_stays_lossless(case, tmp_path):
    from transformers import AutoTokenizer

    n_train, n_eval = (128, 24) if LONG else (64, 10)
    path = tiny_target(family=case.family, tie=case.tie)
    tok = AutoTokenizer.from_pretrained(path)
    target = load_target(str(path), None, device=torch.device("cpu"), full=True)
    batches = regenerated_batches(target, tok, sample_chats(0, n_train), tmp_path, max_new_tokens=NEW_TOKENS)
    mask = tok.convert_tokens_to_ids(MASK_TOKEN)
    cfg = TrainConfig(draft_layers=1, target_layers=tuple(target.layer_ids), block_size=B, anchors=16,
                      mask_token_id=mask, lr=5e-3, warmup=0.05, total_steps=case.epochs * len(batches),
                      log_position_every=0, seed=0)
    with capture_logs():
        state = train(cfg, load_target_heads(path), epochs(batches, case.epochs))
    assert state.end_reason == "end_of_stream"

    torch.manual_seed(0)
    untrained = DFlashDraft(state.model.cfg)
    held_out = [Prompt(f"chat{n_train + i}", prompt_ids(c, tok)) for i, c in enumerate(sample_chats(n_train, n_eval))]
    model, stops = target.model, stop_ids(target.model, tok)
    reports = {}
    for name, m in (("untrained", untrained), ("trained", state.model)):
        drafter = Drafter(m.eval(), B, mask, target.layer_ids, target.num_layers, {})
        reports[name] = evaluate(model, drafter, held_out, max_new_tokens=NEW_TOKENS, stops=stops)
    before, after = reports["untrained"], reports["trained"]
    print(f"\n{case.family} tied={case.tie}: tau untrained {before['tau']} -> trained {after['tau']} "
          f"(pooled {after['tau_pooled']}), accepted {after['accepted']}/{after['drafted']}, "
          f"speedup {after['speedup']}x, histogram {after['tau_hist']}")
    assert before["mismatches"] == [] and after["mismatches"] == []  # lossless, every prompt
    assert after["accepted"] > 0  # so the lossless check covered accepted drafts too
    assert before["tau"] < 1.05
    assert after["tau"] >= case.min_tau and after["tau"] > before["tau"] + 0.05
