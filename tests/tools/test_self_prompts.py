"""dflash-prompts: the target writes broad prompts itself (task families steered through its
chat template, near-duplicates removed, counts per family, a held-out split, progress).

Unit: the template is cut where a user message starts and the turn-end token found for
every family the producer supports; the sampler draws from softmax(logits / T); rejections
have their reasons; the near-duplicate rule is the exact Jaccard rule; family weights add
up; held-out rows come first and are interleaved. On the real SmolLM2 target, on CPU: the
steering gives rows of every family (a follow-up is a first request, the target's own
greedy answer and a second request), a near-greedy target's repeats are dropped as
near-duplicates, `--holdout` rows are in their own file only and read whole by the
evaluation, and the progress is a bar on a terminal and log lines in a pipe.
"""

import json
import math
import os
import random
import re
import subprocess
import sys
from collections import deque
from itertools import combinations

import pytest
import torch

from dflash.producers.data import open_dataset
from dflash.decoding.greedy import GreedyDecoder, Job, Sampler, greedy_generate
from dflash.runtime.targets import load_causal_lm, load_tokenizer
from dflash.tools import real_target
from dflash.consumers.evaluation.evaluate import prompt_ids, read_prompts
from dflash.tools.near_dup import NearDupIndex, jaccard, shingles
from dflash.tools.prompt_families import FAMILIES, FamilySpecError, on_family, parse_families, split_count
from dflash.tools.prompt_writer import PromptError, PromptWriter, Written, judge, turn_end_ids, user_turn
from dflash.tools.self_prompts import holdout_path, interleave, split_rows
from tests.harness.tiny import tiny_dir
from tests.harness.terminal import on_a_terminal

TURN_ENDS = {"qwen3": "<|im_end|>", "llama": "<|eot_id|>", "gemma": "<end_of_turn>"}
LONG = os.environ.get("DFLASH_LONG") == "1"


# ---------------------------------------------------------------- unit


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
    excl = [re.compile("riddle", re.I)]
    markup = ["<|im_start|>"]
    assert judge("me a story.", True, markup, excl, "Tell me a story.") is None
    assert judge("me a", False, markup, excl, "Tell me a") == "unfinished"
    assert judge("", True, markup, excl, "Write a poem about") == "empty"  # nothing after the opening
    assert judge("Hi<|im_start|>assistant", True, markup, excl, "Hi<|im_start|>assistant") == "markup"
    assert judge("a Riddle.", True, markup, excl, "Solve a Riddle.") == "excluded"
    assert judge("this one", True, markup, excl, "Solve this riddle: this one") == "excluded"  # the opening counts


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


@pytest.mark.unit
def test_near_duplicates_are_the_jaccard_rule_on_word_trigrams():
    ix = NearDupIndex(0.6)
    assert ix.keep("Write a Python function that reverses a string.") is None
    assert ix.keep("write a python function, that reverses a STRING!") == 0  # an exact repeat, case and marks aside
    assert ix.keep("Write a Python function that reverses a list.") == 0  # one word of 8 changed: J = 5/7
    assert ix.keep("Write a Python function that parses a date from an ISO string.") is None  # shares the opening
    assert ix.keep("What is the capital of France?") is None
    assert ix.keep("what is the capital of france") == 2  # the third text kept
    # The index finds what comparing every pair finds: 600 variants (0 to 3 words changed) of
    # 60 sentences, so that similarities spread from 0 to 1.
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(200)]
    base = [[rng.choice(vocab) for _ in range(rng.randint(6, 14))] for _ in range(60)]
    texts = []
    for _ in range(600):
        w = list(rng.choice(base))
        for _ in range(rng.randint(0, 3)):
            w[rng.randrange(len(w))] = rng.choice(vocab)
        texts.append(" ".join(w))
    ix, kept, found, missed = NearDupIndex(0.6), [], 0, 0
    for t in texts:
        dup, _ = ix.check(t)
        brute = max((jaccard(shingles(t), shingles(k)) for k in kept), default=0.0)
        if dup is not None:
            assert jaccard(shingles(t), ix.sets[dup]) >= 0.6  # a reported near-duplicate meets the rule
            found += 1
        else:
            assert brute < 1.0  # an exact repeat is never missed
            missed += brute >= 0.6
            ix.add(t)
            kept.append(t)
    assert found > 100 and missed <= 0.02 * found, (found, missed)  # LSH rarely misses one (near_dup.py)
    with pytest.raises(ValueError, match="threshold"):
        NearDupIndex(0.0)


@pytest.mark.unit
def test_families_are_balanced_by_default_and_weighted_on_request():
    assert split_count(20000, parse_families(None)) == {n: 2857 + (i < 1) for i, n in enumerate(FAMILIES)}
    assert sum(split_count(20000, parse_families("all")).values()) == 20000
    assert split_count(10, parse_families("programming=3,maths,follow_up")) == {
        "programming": 6, "maths": 2, "follow_up": 2}
    for bad, says in [("poetry", "'poetry' is not a family"), ("maths=0", "must be > 0"), ("maths=x", "not a number"),
                      ("maths,maths", "given twice"), (",", "no family")]:
        with pytest.raises(FamilySpecError, match=says):
            parse_families(bad)


@pytest.mark.unit
def test_held_out_rows_come_first_per_family_and_files_interleave_families():
    from dflash.tools.prompt_writer import FamilyTally

    def rows(fam, n):
        return [Written(fam, [{"role": "user", "content": f"{fam} {i}"}]) for i in range(n)]

    tallies = {"maths": FamilyTally(kept=rows("maths", 5)), "factual": FamilyTally(kept=rows("factual", 9))}
    train, held, surplus = split_rows(tallies, {"maths": 3, "factual": 6}, holdout=2)
    assert [r.messages[0]["content"] for r in held] == ["maths 0", "factual 0", "maths 1", "factual 1"]
    assert sorted(r.messages[0]["content"] for r in train) == [f"factual {i}" for i in range(2, 8)] + [
        f"maths {i}" for i in range(2, 5)]
    assert surplus == 1  # factual 8: kept past what was asked, written nowhere (and reported)
    assert [r.family for r in interleave({"a": rows("a", 2), "b": rows("b", 4)})] == ["b", "a", "b", "b", "a", "b"]
    assert holdout_path(__import__("pathlib").Path("d/prompts.jsonl")).name == "prompts.holdout.jsonl"


@pytest.mark.unit
def test_the_evaluation_reads_a_conversation_that_ends_in_a_user_turn_whole():
    tok = load_tokenizer(tiny_dir("qwen3", False))
    follow = [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7."},
              {"role": "user", "content": "Now a larger one."}]
    whole = tok.apply_chat_template(follow, tokenize=False, add_generation_prompt=True)
    assert prompt_ids({"messages": follow}, tok) == tok(whole, add_special_tokens=False)["input_ids"]
    # a chat with its answers is still cut before the first answer
    first = tok.apply_chat_template(follow[:1], tokenize=False, add_generation_prompt=True)
    assert prompt_ids({"messages": follow + [{"role": "assistant", "content": "11."}]}, tok) == \
        tok(first, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- the real target


@pytest.fixture(scope="module")
def smollm2():
    folder = real_target.hf_folder()
    return folder, load_tokenizer(folder), load_causal_lm(folder, dtype=torch.float32).eval()


@pytest.mark.real_target
@pytest.mark.unit
def test_a_near_greedy_targets_repeats_are_dropped_as_near_duplicates(smollm2):
    _, tok, model = smollm2
    # Unsteered, at a temperature near 0 the target writes the same request every time: the
    # first is kept, every other one is a near-duplicate, and two cannot be had.
    writer = PromptWriter(model, tok, steer="none", temperature=1e-4, max_new_tokens=48, rows=4)
    with pytest.raises(PromptError, match=r"'factual': '1/2'.*'near_duplicate': 3"):
        writer.write({"factual": 2}, max_tries=4)


@pytest.mark.real_target
@pytest.mark.unit
def test_too_few_usable_prompts_is_an_error_not_a_shorter_file(smollm2):
    _, tok, model = smollm2
    # 4 new tokens are too few for the target to finish a request: every candidate is cut
    writer = PromptWriter(model, tok, max_new_tokens=4, rows=8)
    with pytest.raises(PromptError, match=r"in 6 candidates: \{'maths': '0/3'\}.*'unfinished': 6"):
        writer.write({"maths": 3}, max_tries=6)


def _prompts(folder, out, *args, tty=False, timeout=600):
    """Run dflash-prompts; stderr a pipe, or a pseudo-terminal with `tty`. Returns (rc, stdout, stderr)."""
    cmd = [sys.executable, "-m", "dflash.tools.self_prompts", "--target", str(folder), "--out", str(out),
           "--max-new-tokens", "48", "--answer-tokens", "32", "--batch-size", "16", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(DFLASH_LOG_JSON="1", OMP_NUM_THREADS="1")  # two threads on two busy cores crawl
    if not tty:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        return r.returncode, r.stdout, r.stderr
    rc, err, out_text = on_a_terminal(cmd, env, timeout)
    return rc, out_text, err


PER_FAMILY = 3 if LONG else 1


@pytest.fixture(scope="module")
def written(smollm2, tmp_path_factory):
    """One dflash-prompts run in a pipe: PER_FAMILY training rows and one held-out row per family."""
    folder, _, _ = smollm2
    out = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rc, stdout, stderr = _prompts(folder, out, "--count", str(PER_FAMILY * len(FAMILIES)), "--holdout", "1",
                                  "--exclude", "riddle")
    assert rc == 0, stderr[-3000:]
    return out, json.loads(stdout), stderr


@pytest.mark.real_target
@pytest.mark.integration
def test_the_family_steering_writes_rows_of_every_family(smollm2, written):
    folder, tok, model = smollm2
    out, report, _ = written
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"self-{i}" for i in range(len(rows))]
    assert sorted(r["family"] for r in rows) == sorted(list(FAMILIES) * PER_FAMILY)
    for name, c in report["families"].items():  # counted per family, every candidate accounted for
        assert c["train"] == PER_FAMILY and c["holdout"] == 1
        assert c["candidates"] >= c["kept"] + sum(c["rejected"].values()) - c.get("answers_cut", 0) >= 2
    ds = open_dataset(out)  # what dflash-produce --data reads
    assert len(ds) == len(rows) and all(ds.read(i).messages for i in range(len(ds)))
    for r in rows:
        fam, msgs = FAMILIES[r["family"]], r["messages"]
        request = msgs[-1]["content"]
        assert request == request.strip() and "riddle" not in request.lower()
        assert not any(s in request for s in tok.all_special_tokens if len(s) > 1)
        # steered by a pre-filled opening of its family (a language drawn into {lang})
        assert any(re.fullmatch(re.escape(o).replace(r"\{lang\}", ".+?") + ".*", request, re.S)
                   for o in fam.openings), request
        if fam.follow_up:  # a first request, the target's own greedy answer to it, the follow-up
            assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
            ids = tok(tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"]
            (answer,) = greedy_generate(model, [ids], max_new_tokens=32, stop_ids={tok.convert_tokens_to_ids(
                "<|im_end|>")}, batch_size=1)
            assert tok.decode(answer, skip_special_tokens=True).strip() == msgs[1]["content"]
        else:
            assert [m["role"] for m in msgs] == ["user"]
    # and of their family by its criterion (prompt_families.py), all but a sampled stray one
    single = [r for r in rows if not FAMILIES[r["family"]].follow_up]
    requests = [(FAMILIES[r["family"]], r["messages"][-1]["content"]) for r in single]
    assert sum(on_family(f, q) for f, q in requests) >= len(single) - max(1, len(single) // 10), requests


@pytest.mark.real_target
@pytest.mark.integration
def test_holdout_rows_are_in_their_own_file_only(smollm2, written):
    _, tok, _ = smollm2
    out, report, _ = written
    held_file = out.with_name("prompts.holdout.jsonl")
    assert report["holdout_out"] == str(held_file) and report["holdout"] == len(FAMILIES)
    held = [json.loads(x) for x in held_file.read_text().splitlines()]
    train = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["family"] for r in held) == sorted(FAMILIES)  # one per family, each family once
    key = lambda r: "\n".join(m["content"] for m in r["messages"] if m["role"] == "user")  # noqa: E731
    for h, t in ((h, t) for h in held for t in train):  # not in training, not even nearly
        assert jaccard(shingles(key(h)), shingles(key(t))) < 0.6, (key(h), key(t))
    for a, b in combinations(train, 2):
        assert jaccard(shingles(key(a)), shingles(key(b))) < 0.6, (key(a), key(b))
    # usable as dflash-consume --eval-prompts: every row read, a follow-up with its whole conversation
    prompts = read_prompts(held_file, tok)
    assert [p.name for p in prompts] == [r["id"] for r in held]
    fu = next(i for i, r in enumerate(held) if r["family"] == "follow_up")
    assert tok.decode(prompts[fu].ids).count("<|im_start|>user") == 2


@pytest.mark.real_target
@pytest.mark.integration
def test_progress_is_a_bar_on_a_terminal_and_log_lines_in_a_pipe(smollm2, written, tmp_path):
    folder, _, _ = smollm2
    _, report, stderr = written
    total = len(FAMILIES) * (PER_FAMILY + 1)
    assert "prompt/s" not in stderr and "|" not in stderr  # no bar in a pipe
    lines = [json.loads(x) for x in stderr.splitlines() if x.startswith("{")]
    prog = [x for x in lines if x["event"] == "progress.update"]
    assert prog and prog[-1]["what"] == "prompts" and prog[-1]["done"] == prog[-1]["total"] == total
    (done,) = [x for x in lines if x["event"] == "prompts.done"]
    assert done["families"] == report["families"] and done["prompts"] == report["prompts"]
    rc, stdout, err = _prompts(folder, tmp_path / "p.jsonl", "--count", "2", "--families", "maths,factual", tty=True)
    assert rc == 0, err[-3000:]
    assert "prompts: 100%" in err and "2/2" in err and "prompt/s" in err  # tqdm's bar on the terminal
    assert not any(json.loads(x)["event"] == "progress.update" for x in err.splitlines() if x.startswith("{"))
    assert json.loads(stdout)["prompts"] == 2
