"""decoding/endings.py: the degenerate-repetition detector on hand-made token sequences
(loops of several periods, near-loops and natural repeats that must not trigger), its
torch form on a decoder's output tensor equal to the pure one, and the ending reasons."""

from __future__ import annotations

import random

import pytest
import torch

from dflash.decoding.endings import CAP, COPY, EOS, REPETITION, SPAN, EndingRule, classify, decoded_ending, loop_period, looping, \
    looping_rows, repetition_cut

pytestmark = pytest.mark.unit

RULE = EndingRule(tail=64, max_period=64, repeats=3)
COPY_RULE = EndingRule(tail=64, max_period=64, repeats=3, keep=COPY)


def text(n: int, seed: int = 0) -> list[int]:
    """n tokens with no repeat structure (distinct IDs)."""
    rng = random.Random(seed)
    return rng.sample(range(1000, 100000), n)


@pytest.mark.parametrize("period", [1, 2, 7, 21, 40, 64])
def test_a_loop_of_each_period_is_found_and_cut_after_its_span_or_its_first_copy(period):
    head, block = text(50), text(period, seed=period)
    copies = -(-RULE.span(period) // period) + 1
    ids = head + block * copies
    assert loop_period(ids, RULE) == period
    # the default keeps the head and the loop over the span that shows it: the repeats are trained
    assert repetition_cut(ids, RULE) == len(head) + RULE.span(period) < len(ids)
    assert ids[len(head) + period:len(head) + RULE.span(period)] == (block * copies)[:RULE.span(period) - period]
    assert repetition_cut(ids, COPY_RULE) == len(head) + period  # the head and one copy of the block
    # a loop cut mid-block (the cap falls anywhere) is cut at the same place
    assert repetition_cut(ids + block[: period // 2], RULE) == len(head) + RULE.span(period)
    assert repetition_cut(ids + block[: period // 2], COPY_RULE) == len(head) + period


def test_what_a_loop_keeps_is_part_of_the_rule():
    assert EndingRule().keep == SPAN and RULE.describe() != COPY_RULE.describe()
    with pytest.raises(ValueError, match="keep='all'"):
        EndingRule(keep="all")


def test_a_loop_is_found_only_once_it_is_long_enough():
    head, block = text(30), text(5, seed=1)
    for k in range(1, 40):
        ids = head + block * k
        periodic = 5 * k
        assert looping(ids, RULE) == (periodic >= RULE.span(5)), k
    # a long period needs `repeats` copies, not only `tail` tokens
    block = text(50, seed=2)
    assert not looping(head + block * 2, RULE)  # 100 periodic tokens: 2 copies
    assert looping(head + block * 3, RULE)


def test_a_period_longer_than_max_period_is_not_a_loop():
    block = text(65, seed=3)
    assert not looping(text(10) + block * 5, RULE)
    assert looping(text(10) + block * 5, EndingRule(max_period=65))


def test_near_loops_and_natural_repeats_do_not_trigger():
    rng = random.Random(4)
    # a numbered list: each item the same words but its number differs
    items = [t for i in range(30) for t in (500 + i, 11, 12, 13, 14, 15)]
    assert not looping(text(20) + items, RULE)
    # a loop with one token changed every so often (a counter, a changing word)
    block = text(9, seed=5)
    near = [t for i in range(20) for t in block[:-1] + [2000 + i]]
    assert not looping(near, RULE)
    # a table's separator row and a short refrain: periodic, but shorter than `tail`
    sep = [7, 8] * 20
    assert not looping(text(40) + sep, RULE)
    refrain = text(6, seed=6) * 5
    assert not looping(text(40) + refrain + text(20, seed=7), RULE)
    # a loop that ended: new text after it is no loop any more
    assert not looping(text(10) + text(4, seed=8) * 30 + text(5, seed=9), RULE)
    # random text over a small vocabulary: chance matches do not add up to a loop
    small = [rng.randrange(20) for _ in range(3000)]
    assert decoded_ending(small, set(), RULE, sync_every=1)[0] == CAP


def test_decoded_ending_is_what_a_decoder_checking_at_its_sync_points_keeps():
    head, block = text(100), text(6, seed=10)
    ids = head + block * 40 + text(50, seed=11)
    # checked after every token: stopped as soon as the loop is `tail` long, kept that far (or one copy)
    assert decoded_ending(ids, set(), RULE, sync_every=1) == (REPETITION, 164, 164)
    assert decoded_ending(ids, set(), COPY_RULE, sync_every=1) == (REPETITION, 106, 164)
    # checked after 1 + 8k tokens: stopped at the next such point, cut at the same place
    assert decoded_ending(ids, set(), RULE, sync_every=8) == (REPETITION, 164, 169)
    assert decoded_ending(ids, set(), COPY_RULE, sync_every=8) == (REPETITION, 106, 169)
    # a loop that breaks off between two checks is not seen
    short = text(100) + block * 11 + text(50, seed=11)  # periodic over tokens 100..166: long enough at 164
    assert decoded_ending(short, set(), RULE, sync_every=1)[0] == REPETITION
    assert decoded_ending(short, set(), RULE, sync_every=8) == (CAP, len(short), len(short))
    assert decoded_ending(text(300), set(), RULE) == (CAP, 300, 300)
    assert decoded_ending(text(300) + [2], {2}, RULE) == (EOS, 301, 301)
    assert decoded_ending(head + block * 40, set(), None) == (CAP, 340, 340)


def test_classify_keeps_eos_answers_whole_and_cuts_loops():
    stops = {2}
    block = text(3, seed=12)
    looped = text(20) + block * 40
    assert classify(looped + [2], stops, RULE) == (EOS, len(looped) + 1)  # it ended: kept whole
    assert classify(looped, stops, RULE) == (REPETITION, 20 + 64)
    assert classify(looped, stops, COPY_RULE) == (REPETITION, 23)
    assert classify(looped, stops, None) == (CAP, len(looped))  # no rule: unfinished
    assert classify(text(90), stops, RULE) == (CAP, 90)


def test_the_tensor_form_equals_the_pure_one():
    rng = random.Random(13)
    rule = EndingRule(tail=24, max_period=16, repeats=3)
    cases = []
    for i in range(300):
        kind = i % 4
        if kind == 0:
            ids = [rng.randrange(5) for _ in range(rng.randrange(1, 120))]
        elif kind == 1:
            p = rng.randrange(1, 20)
            block = [rng.randrange(50) for _ in range(p)]
            ids = [rng.randrange(50) for _ in range(rng.randrange(0, 30))] + block * rng.randrange(1, 10)
        elif kind == 2:
            ids = [rng.randrange(3) for _ in range(rng.randrange(20, 60))]
        else:
            ids = [rng.randrange(1000) for _ in range(rng.randrange(1, 100))]
        cases.append(ids[:100])
    width = 100
    out = torch.full((len(cases), width), -1, dtype=torch.long)
    for r, ids in enumerate(cases):
        out[r, :len(ids)] = torch.tensor(ids)
        out[r, len(ids):] = torch.tensor([rng.randrange(5) for _ in range(width - len(ids))])  # stale tokens
    n = torch.tensor([len(c) for c in cases])
    got = looping_rows(out, n, rule).tolist()
    want = [looping(c, rule) for c in cases]
    assert got == want
    assert 20 < sum(want) < 280  # both kinds of case are there


def test_a_bad_rule_is_refused():
    with pytest.raises(ValueError, match="repeats"):
        EndingRule(repeats=1)
