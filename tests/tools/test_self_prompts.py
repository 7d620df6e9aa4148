"""dflash-prompts: the target writes user prompts (the opening of a user turn, sampled).

The template is cut where a user message starts and the turn-end token is found for every
family the producer supports; the sampler draws from softmax(logits / T) (checked against
the exact probabilities); candidates are rejected for a stated reason, counted, and the
command fails rather than write fewer prompts than asked. On the real SmolLM2 target, on
CPU: the prompts are distinct, finished requests in the producer's --data format."""

import json
import math
import re
import subprocess
import sys
from collections import deque

import pytest
import torch

from dflash.producers.data import open_dataset
from dflash.decoding.greedy import GreedyDecoder, Job, Sampler
from dflash.runtime.targets import load_causal_lm, load_tokenizer
from dflash.tools import real_target
from dflash.tools.self_prompts import PromptError, judge, turn_end_ids, user_turn, write_prompts
from tests.harness.tiny import tiny_dir

TURN_ENDS = {"qwen3": "<|im_end|>", "llama": "<|eot_id|>", "gemma": "<end_of_turn>"}


@pytest.mark.unit
@pytest.mark.parametrize("family", sorted(TURN_ENDS))
def test_the_user_turn_opening_and_its_end_token_come_from_the_template(family):
    tok = load_tokenizer(tiny_dir(family, False))
    before, after = user_turn(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert full == before + "hi" + after
    assert "user" in before[-40:]  # the opening ends with the user role header
    ends = turn_end_ids(tok, after, set())
    assert tok.convert_tokens_to_ids(TURN_ENDS[family]) in ends


@pytest.mark.unit
def test_a_tokenizer_without_a_chat_template_is_refused_by_name():
    tok = load_tokenizer(tiny_dir("qwen3", False))
    tok.chat_template = None
    with pytest.raises(PromptError, match="no chat template"):
        user_turn(tok)


@pytest.mark.unit
def test_every_rejection_has_its_reason():
    seen: set[str] = set()
    excl = [re.compile("riddle", re.I)]
    markup = ["<|im_start|>"]
    assert judge("Tell me a story.", True, markup, excl, seen) is None
    assert judge("tell me  a STORY.", True, markup, excl, seen) == "repeat"
    assert judge("Tell me a", False, markup, excl, seen) == "unfinished"
    assert judge("", True, markup, excl, seen) == "empty"
    assert judge("Hi<|im_start|>assistant", True, markup, excl, seen) == "markup"
    assert judge("Write a Riddle.", True, markup, excl, seen) == "excluded"


@pytest.mark.unit
def test_the_sampler_draws_from_the_tempered_distribution_and_only_the_top_k():
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    n = 40000
    for temperature in (1.0, 0.5):
        draws = Sampler(temperature)(logits.expand(n, -1))
        freq = torch.bincount(draws, minlength=5).float() / n
        p = torch.softmax(logits / temperature, -1)
        # 5 standard errors of a binomial frequency: fails for a wrong distribution, not by chance
        assert torch.all((freq - p).abs() <= 5 * torch.sqrt(p * (1 - p) / n) + 1e-4), (temperature, freq, p)
    top2 = Sampler(1.0, top_k=2)(logits.expand(n, -1))
    assert set(top2.tolist()) == {0, 1}
    share = (top2 == 0).float().mean().item()
    assert abs(share - 1 / (1 + math.exp(-1.0))) < 0.02
    with pytest.raises(ValueError, match="temperature"):
        Sampler(0.0)


@pytest.mark.unit
def test_the_decoder_samples_with_a_sampler_and_stays_greedy_without_one():
    tok = load_tokenizer(tiny_dir("qwen3", False))
    model = load_causal_lm(tiny_dir("qwen3", False), dtype=torch.float32).eval()
    prompt = tok("hello there", add_special_tokens=False)["input_ids"]

    def decode(pick, seed):
        torch.manual_seed(seed)
        dec = GreedyDecoder(model, rows=4, max_prompt=len(prompt), max_new_tokens=12, stop_ids=[-1], pick=pick)
        out = {}
        dec.run(deque(Job(i, prompt) for i in range(8)), lambda j, o: out.__setitem__(j.key, o))
        return [out[i] for i in range(8)]

    greedy = decode(None, 0)
    assert all(o == greedy[0] for o in greedy)  # one prompt, one greedy answer
    sampled = decode(Sampler(1.0), 0)
    assert len({tuple(o) for o in sampled}) > 1
    assert sampled == decode(Sampler(1.0), 0)  # seeded: reproducible


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(2)
    folder = real_target.hf_folder()
    return folder, load_tokenizer(folder), load_causal_lm(folder, dtype=torch.float32).eval()


@pytest.mark.real_target
@pytest.mark.unit
def test_the_real_target_writes_distinct_finished_requests(smollm2):
    _, tok, model = smollm2
    texts, tally = write_prompts(model, tok, 12, max_new_tokens=64, rows=16, seed=1)
    assert len(texts) == 12 == len(set(t.lower() for t in texts))
    assert tally.kept >= 12 and tally.tried == tally.kept + sum(tally.dropped.values())
    specials = [t for t in tok.all_special_tokens if len(t) > 1]
    for t in texts:
        assert t and t == t.strip() and not any(s in t for s in specials)
    # real requests, not noise: most have several words and the words are English-like
    assert sum(len(t.split()) >= 4 for t in texts) >= 9


@pytest.mark.real_target
@pytest.mark.unit
def test_too_few_usable_prompts_is_an_error_not_a_shorter_file(smollm2):
    _, tok, model = smollm2
    # 4 new tokens are too few for the target to finish a request: every candidate is cut
    with pytest.raises(PromptError, match=r"wrote 0 usable prompts of the 3 asked for in 6 candidates.*unfinished"):
        write_prompts(model, tok, 3, max_new_tokens=4, rows=8, max_tries=6)


@pytest.mark.real_target
@pytest.mark.integration
def test_the_command_writes_the_producers_data_format(smollm2, tmp_path):
    folder, _, _ = smollm2
    out = tmp_path / "prompts.jsonl"
    r = subprocess.run([sys.executable, "-m", "dflash.tools.self_prompts", "--target", str(folder), "--count", "6",
                        "--out", str(out), "--max-new-tokens", "64", "--batch-size", "8", "--exclude", "(python"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode != 0 and "--exclude" in r.stderr and "'(python'" in r.stderr  # a bad pattern, named
    r = subprocess.run([sys.executable, "-m", "dflash.tools.self_prompts", "--target", str(folder), "--count", "6",
                        "--out", str(out), "--max-new-tokens", "64", "--batch-size", "8", "--exclude", "python"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)  # the report alone: logs go to stderr
    assert report["prompts"] == 6 and report["candidates"] == report["usable"] + sum(report["rejected"].values())
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [f"self-{i}" for i in range(6)]
    ds = open_dataset(out)  # what dflash-produce --data reads
    rows = [ds.read(i) for i in range(len(ds))]
    assert len(rows) == 6
    assert all(r.messages[0]["role"] == "user" and "python" not in r.messages[0]["content"].lower() for r in rows)
