"""How regenerated answers end (issue 35): on a tiny random target (its greedy answers loop
readily) a looping row stops early at the decoder's sync point and is cut after the span that shows
its loop (the repeats kept), exactly where the uncut answer first loops; answers that end by a stop
token are unchanged and equal to Hugging Face generate()'s; the regenerator records each
answer's ending, logs the counts per reason, and keeps them in its cache; the producer
skips and reports rows whose ending `--regen-drop` names, and trains the rest."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from structlog.testing import capture_logs
from transformers import AutoTokenizer

from tests.harness.tiny import tiny_dir
from tests.producers.helpers import write_jsonl

from dflash.decoding.endings import COPY, EOS, REPETITION, EndingRule, classify, decoded_ending
from dflash.decoding.greedy import GreedyDecoder
from dflash.producers.chat import ChatEncoder
from dflash.producers.data import Row, open_dataset
from dflash.producers.producer import LocalWorkSource, Producer
from dflash.producers.producer_config import ProducerConfig
from dflash.producers.regenerate import DROP_REASONS, RegenCache, Regenerator, cache_key, stop_ids
from dflash.producers.target import load_target

pytestmark = pytest.mark.integration

CPU = torch.device("cpu")
NEW = 160
SYNC = 8
# A shorter rule than the default (regenerate.py LOOP_RULE), so that the tiny target's answers loop within a
# cap that keeps these tests fast; the code paths are the same for any rule.
RULE = EndingRule(tail=16, max_period=16, repeats=3)


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    tiny = tiny_dir("qwen3", False)  # one family: the subject is the ending rule, not the model
    tok = AutoTokenizer.from_pretrained(tiny)
    target = load_target(str(tiny), None, device=CPU, full=True)
    return tiny, tok, target


def _prompt(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Question {i}: what is {i} plus {i % 5}?"}]


def _prompts(tok, n: int) -> list[list[int]]:
    return [tok(tok.apply_chat_template(_prompt(i), tokenize=False, add_generation_prompt=True),
                add_special_tokens=False)["input_ids"] for i in range(n)]


def _decode(model, prompts, stops, ending=None) -> list[list[int]]:
    dec = GreedyDecoder(model, rows=8, max_prompt=max(map(len, prompts)), max_new_tokens=NEW, stop_ids=stops,
                        sync_every=SYNC, ending=ending)
    return dec.generate(prompts)


@pytest.fixture(scope="module")
def uncut(setup):
    """Prompts, the target's stop tokens, and its greedy answers without an ending rule."""
    _, tok, target = setup
    prompts = _prompts(tok, 12)
    stops = stop_ids(target.model, tok)
    return prompts, stops, _decode(target.model, prompts, stops)


def test_a_looping_row_stops_early_and_is_cut_where_it_first_loops(setup, uncut):
    _, tok, target = setup
    prompts, stops, full = uncut
    ruled = _decode(target.model, prompts, stops, RULE)
    looped = 0
    for f, r in zip(full, ruled):
        # stopped at the first sync point where its tail loops, cut after the span that shows the loop
        reason, keep, stopped = decoded_ending(f, stops, RULE, SYNC)
        assert r == f[:stopped]  # the same greedy tokens, only fewer
        assert classify(r, stops, RULE) == (reason, keep)
        if reason == REPETITION:  # the repeats are kept, not only the block's first copy
            assert keep > classify(r, stops, replace(RULE, keep=COPY))[1]
        looped += reason == REPETITION and stopped < NEW
    assert looped >= 3, "the tiny target no longer loops: pick prompts or a cap where it does"
    assert sum(map(len, ruled)) < sum(map(len, full))


def test_answers_that_end_by_a_stop_token_are_unchanged_and_equal_generate(setup, uncut):
    tiny, tok, target = setup
    prompts, base, full = uncut
    # A stop token the target emits before some rows loop and after others do: both kinds here.
    cuts = [decoded_ending(f, base, RULE, SYNC)[2] for f in full]
    firsts = [{t: i for i, t in reversed(list(enumerate(f)))} for f in full]
    candidates = sorted({t for f in full for t in f} - base)

    def split(t):  # rows it would end, rows that would loop first
        ends = [t in fi and fi[t] < c for fi, c in zip(firsts, cuts)]
        loops = [not e and decoded_ending(f, base, RULE, SYNC)[0] == REPETITION for e, f in zip(ends, full)]
        return min(sum(ends), sum(loops))

    stop = max(candidates, key=lambda t: (split(t), -t))
    stops = base | {stop}
    ruled = _decode(target.model, prompts, stops, RULE)
    reasons = Counter(classify(r, stops, RULE)[0] for r in ruled)
    assert reasons[EOS] >= 2 and reasons[REPETITION] >= 1, reasons
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny).eval()
    for p, r in zip(prompts, ruled):
        if classify(r, stops, RULE)[0] != EOS:
            continue
        with torch.no_grad():
            ids = torch.tensor([p])
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(r), do_sample=False,
                                eos_token_id=sorted(stops), pad_token_id=0)[0, len(p):].tolist()
        assert r == want


def test_regeneration_records_endings_logs_counts_and_caches_them(setup, tmp_path):
    _, tok, target = setup
    rows = [Row(i, f"d:{i}", messages=_prompt(i)) for i in range(10)]
    uncut = Regenerator(target, tok, RegenCache(tmp_path, "off"), max_new_tokens=NEW, batch_size=8, loops=None)
    plain = uncut.apply(rows)
    assert {e for r in plain for e in r.endings} <= {EOS, "cap"}  # no rule: nothing is cut
    key = cache_key("fp", target, tok, NEW, {}, loops=RULE)
    assert key != cache_key("fp", target, tok, NEW, {}, loops=None)  # a rule change is a new cache
    assert key != cache_key("fp", target, tok, NEW, {}, loops=EndingRule(tail=32))
    assert key != cache_key("fp", target, tok, NEW, {}, loops=replace(RULE, keep=COPY))  # what a loop keeps
    assert key != cache_key("fp", target, tok, NEW, {})  # the default rule
    regen = Regenerator(target, tok, RegenCache(tmp_path, key), max_new_tokens=NEW, batch_size=8, loops=RULE)
    with capture_logs() as logs:
        got = regen.apply(rows)
    counts = Counter(e for r in got for e in r.endings)
    assert counts[REPETITION] >= 3
    (line,) = [e for e in logs if e["event"] == "produce.regen"]
    assert line["endings"] == {"eos": counts[EOS], "repetition": counts[REPETITION], "cap": counts["cap"]}
    assert regen.endings == line["endings"]
    assert line["new_tokens"] < uncut.new_tokens  # the looping rows stopped early
    stops = stop_ids(target.model, tok)
    for p, r in zip(plain, got):
        a = r.loss_mask.index(1)
        answer = r.input_ids[a:a + sum(r.loss_mask)]
        full = p.input_ids[a:a + sum(p.loss_mask)]
        reason, keep, _ = decoded_ending(full, stops, RULE, SYNC)
        assert r.endings == (reason,) and answer == full[:keep]
    again = Regenerator(target, tok, RegenCache(tmp_path, key), max_new_tokens=NEW, loops=RULE)
    assert [r.endings for r in again.apply(rows)] == [r.endings for r in got] and again.generated == 0


@pytest.mark.parametrize("drop,ahead", [(("repetition",), 0), (("cap",), 0), (("cap", "repetition"), 0),
                                        (("cap", "repetition"), 64)])
def test_the_producer_skips_and_reports_rows_whose_ending_is_dropped(setup, tmp_path, drop, ahead):
    _, tok, target = setup
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": _prompt(i)} for i in range(10)]
                       + [{"text": "a plain text row"}])
    data = open_dataset(path)
    regen = Regenerator(target, tok, RegenCache(tmp_path / "cache", "k"), max_new_tokens=NEW, batch_size=8, loops=RULE,
                        drop=drop)
    endings = {s: r.endings for s, r in zip(range(10), regen.apply([data.read(s) for s in range(10)]))}
    source = LocalWorkSource(len(data), lease_size=4)
    sent = []
    prod = Producer(target, data, ChatEncoder(tok, 4096), source, sent.append, token_budget=2048,
                    max_batch_size=4, regenerator=regen, regen_ahead=ahead)
    with capture_logs() as logs:
        summary = prod.run()
    dropped = {s for s, e in endings.items() if set(e) & set(drop)}
    assert dropped, f"no answer ended by {drop}: the test shows nothing"
    skipped = {s: why for pairs in source.done.values() for s, why in pairs}
    assert skipped == {s: DROP_REASONS[next(d for d in ("repetition", "cap") if d in endings[s] and d in drop)]
                       for s in dropped}
    trained = sorted(s for b in sent for s in b.samples)
    assert trained == sorted(set(range(11)) - dropped)  # every sample trained or reported, once
    assert summary["answers_dropped"] == len(dropped) == summary["skipped"]
    assert len([e for e in logs if e["event"] == "produce.answer_dropped"]) == len(dropped)
    counted = Counter()  # each lease's produce.regen counts its rows' endings (made ahead or not)
    for e in logs:
        if e["event"] == "produce.regen":
            counted.update(e["endings"])
    assert counted == Counter(x for e in endings.values() for x in e)


def test_bad_drop_options_are_refused():
    with pytest.raises(ValueError, match="--regen-drop 'eos'"):
        ProducerConfig(target="t", data="d", regen_drop="eos").check()
    with pytest.raises(ValueError, match="needs --regen-loops"):
        ProducerConfig(target="t", data="d", regen_drop="repetition", regen_loops=False).check()
    assert ProducerConfig(target="t", data="d", regen_drop="cap, repetition").drop() == ("cap", "repetition")
    assert ProducerConfig(target="t", data="d").drop() == ()



def test_the_producer_command_sets_what_a_loop_keeps_and_keys_its_cache_by_it(setup, tmp_path):
    from dflash.producers.build import load_components

    tiny, _, _ = setup
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": _prompt(i)} for i in range(2)])
    got = {}
    for keep in ("span", "copy", None):  # None: the command's default
        opts = {"regen_loop_keep": keep} if keep else {}
        cfg = ProducerConfig(target=str(tiny), data=str(data), regenerate=True, device="cpu", check_packing=False,
                             regen_cache=str(tmp_path / "cache"), **opts)
        with capture_logs() as logs:
            regen = load_components(cfg).regenerator
        (line,) = [e for e in logs if e["event"] == "produce.regen_cache"]
        got[keep] = (regen.loops.keep, line["key"])
    assert [got[k][0] for k in ("span", "copy", None)] == ["span", "copy", "span"]
    assert got["span"][1] == got[None][1] != got["copy"][1]  # answers cut another way are never mixed in
