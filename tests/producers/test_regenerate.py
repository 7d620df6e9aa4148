"""--regenerate: assistant turns become the target's own greedy output, kept as the exact
token IDs it generated (never decoded and re-encoded), turn by turn, with the loss mask on
the generated tokens only; cached on disk so an epoch 2 or a restart does not generate
again. Tiny Qwen3 (untied) and Llama (tied) targets built from configs."""

from __future__ import annotations

import torch
from structlog.testing import capture_logs

from dflash.producers.chat import ChatEncoder
from dflash.producers.data import Row
from dflash.producers.regenerate import RegenCache, Regenerator, cache_key, stop_ids
from dflash.producers.target import load_target
from dflash.producers.sample_data import generate_chats
import pytest

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
CHAT = [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Count to 3."}, {"role": "assistant", "content": "1 2 3"}]
NEW = 6


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of every run of 1s."""
    out, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def reference_greedy(model, prefix: list[int], n: int, stops: set[int]) -> list[int]:
    """The plain HF model's greedy continuation of exactly `prefix`, one row, no padding."""
    with torch.no_grad():
        ids = torch.tensor([prefix])  # an explicit mask: the pad ID may be a real token of the prefix
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=sorted(stops), pad_token_id=0)[0, len(prefix):].tolist()
    end = next((i for i, t in enumerate(out) if t in stops), None)
    return out if end is None else out[: end + 1]


def check_exact(row: Row, model, tok, n_turns: int, max_new: int) -> None:
    """Every generated span is the reference model's greedy output after exactly the IDs
    before it; the mask is 1 on those spans and nowhere else; turn 0's prompt is the
    chat template's generation prompt."""
    stops = stop_ids(model, tok)
    turns = spans(row.loss_mask)
    assert len(turns) == n_turns and len(row.input_ids) == len(row.loss_mask)
    for a, b in turns:
        assert row.input_ids[a:b] == reference_greedy(model, row.input_ids[:a], max_new, stops)
        assert b - a == max_new or row.input_ids[b - 1] in stops
    first = tok.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True)
    assert row.input_ids[: turns[0][0]] == tok(first, add_special_tokens=False)["input_ids"]


def test_regenerated_turns_are_the_exact_ids_the_target_generated_and_cached(tiny, tokenizer, reference, tmp_path):
    target = load_target(str(tiny), None, device=CPU, full=True)
    key = cache_key("fp0", target, tokenizer, NEW, {})
    regen = Regenerator(target, tokenizer, RegenCache(tmp_path, key), max_new_tokens=NEW, batch_size=4)
    rows = [Row(0, "d:1", messages=CHAT), Row(1, "d:2", messages=CHAT[:2]), Row(2, "d:3", text="plain")]
    new = regen.apply(rows)

    check_exact(new[0], reference, tokenizer, 2, NEW)
    check_exact(new[1], reference, tokenizer, 1, NEW)
    # Batched with left padding or alone, turn 0 of the same prompt is the same IDs.
    (_, b0), (_, b1) = spans(new[0].loss_mask)[0], spans(new[1].loss_mask)[0]
    assert new[0].input_ids[:b0] == new[1].input_ids[:b1]
    # Template text between turns is the template's: turn 1's prompt ends with the user turn
    # and the assistant header exactly as the template renders them.
    probe = [CHAT[0], {"role": "assistant", "content": "\u2063"}, CHAT[2]]
    tail = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True).split("\u2063")[1]
    (_, end0), (start1, _) = spans(new[0].loss_mask)
    assert tokenizer.decode(new[0].input_ids[end0:start1]) == tail
    assert new[2].text == "plain" and new[2].input_ids is None
    # The producer's encoder trains on exactly these IDs and this mask.
    enc = ChatEncoder(tokenizer, 4096).encode(new[0])
    assert (enc.input_ids, enc.loss_mask) == (new[0].input_ids, new[0].loss_mask)
    assert [m["content"] for m in new[0].messages][0::2] == [CHAT[0]["content"], CHAT[2]["content"]]
    assert regen.generated == 2 and regen.cache_hits == 0

    # A restarted producer (new objects, same cache folder and key) generates nothing and
    # gets the same IDs back.
    again = Regenerator(target, tokenizer, RegenCache(tmp_path, key), max_new_tokens=NEW)
    with capture_logs() as logs:
        cached = again.apply(rows)
    assert [(r.input_ids, r.loss_mask, r.messages) for r in cached[:2]] == \
        [(r.input_ids, r.loss_mask, r.messages) for r in new[:2]]
    assert again.generated == 0 and again.cache_hits == 2
    (ev,) = [e for e in logs if e["event"] == "produce.regen"]
    assert ev["cached"] == 2 and ev["generated"] == 0 and ev["new_tokens"] == 0
    # Other settings are another cache.
    assert cache_key("fp0", target, tokenizer, 7, {}) != key
    assert cache_key("fp1", target, tokenizer, NEW, {}) != key


def test_a_turn_the_target_ends_itself_keeps_its_stop_token_once(tiny, tokenizer, tmp_path):
    """A target that ends its turn emits the template's end marker (<|im_end|>, <|eot_id|>)
    itself: that token is trained (mask 1) and the template's copy is not added again.
    The tiny target's head is changed so that ending the turn wins after two tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    stop = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    assert stop in stop_ids(model, tokenizer)
    prompt = tokenizer(tokenizer.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    first_two = reference_greedy(model, prompt, 2, set())
    with torch.no_grad():  # the stop token's head row: 3x the third greedy token's, which then loses to it
        third = reference_greedy(model, prompt + first_two, 1, set())[0]
        model.get_output_embeddings().weight[stop] = 3 * model.get_output_embeddings().weight[third]
    model.save_pretrained(tmp_path / "ends")  # tied: the stop token's input embedding changed too
    tokenizer.save_pretrained(tmp_path / "ends")
    ends = AutoModelForCausalLM.from_pretrained(tmp_path / "ends").eval()
    expected = reference_greedy(ends, prompt, NEW, stop_ids(ends, tokenizer))
    assert expected[-1] == stop and len(expected) < NEW  # the changed target does end its turn
    target = load_target(str(tmp_path / "ends"), None, device=CPU, full=True)
    regen = Regenerator(target, tokenizer, RegenCache(tmp_path, "k"), max_new_tokens=NEW)
    (row,) = regen.apply([Row(0, "d:1", messages=CHAT)])
    (a, b), _ = spans(row.loss_mask)
    assert row.input_ids[a:b] == expected and row.loss_mask[b - 1] == 1  # the stop token is trained
    assert row.input_ids[b] != stop  # the template's own end marker is not added after it
    check_exact(row, ends, tokenizer, 2, NEW)


def test_ids_differ_from_the_text_round_trip_for_some_rows(tiny, tokenizer, reference, tmp_path):
    """What the old text cache lost: decoding a random target's turn and encoding it again
    does not give its IDs back for every row (split UTF-8 characters, other merges); the
    IDs kept are the generated ones in every row."""
    target = load_target(str(tiny), None, device=CPU, full=True)
    firsts = [next(i for i, m in enumerate(c["messages"]) if m["role"] == "assistant") for c in generate_chats()[:12]]
    chats = [c["messages"][: i + 1] for c, i in zip(generate_chats()[:12], firsts)]  # up to the first answer
    regen = Regenerator(target, tokenizer, RegenCache(tmp_path, "k"), max_new_tokens=16, batch_size=12)
    rows = regen.apply([Row(i, f"d:{i}", messages=m) for i, m in enumerate(chats)])
    stops = stop_ids(reference, tokenizer)
    lost = 0
    for r in rows:
        ((a, b),) = spans(r.loss_mask)
        assert r.input_ids[a:b] == reference_greedy(reference, r.input_ids[:a], 16, stops)
        text_ids = tokenizer(tokenizer.decode(r.input_ids[a:b], skip_special_tokens=True).strip(),
                             add_special_tokens=False)["input_ids"]
        lost += text_ids != [t for t in r.input_ids[a:b] if t not in stops]
    print(f"\n{lost} of {len(rows)} regenerated turns change in a decode, strip, encode round trip (the text cache)")


def test_a_row_the_template_cannot_render_is_a_bad_row_named_before_generating(tiny, tokenizer, tmp_path):
    import copy

    import pytest

    from dflash.producers.data import BadRow

    target = load_target(str(tiny), None, device=CPU, full=True)
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (  # refuses system turns, and upper-cases answers (not rendered verbatim)
        "{%- for m in messages %}{%- if m['role'] == 'system' %}{{ raise_exception('no system turns') }}{%- endif %}"
        "{{- m['role'] + ': ' + (m['content'] | upper if m['role'] == 'assistant' else m['content']) + '\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}")
    regen = Regenerator(target, tok, RegenCache(tmp_path, "k"), max_new_tokens=NEW)
    with pytest.raises(BadRow, match=r"d:7: chat template failed: .*no system turns"):
        regen.check(Row(7, "d:7", messages=[{"role": "system", "content": "s"}, *CHAT[:2]]))
    with pytest.raises(BadRow, match=r"d:8: the chat template does not render assistant turn 0 \(0-based\) verbatim"):
        regen.check(Row(8, "d:8", messages=CHAT))
    regen.check(Row(10, "d:10", text="plain"))  # nothing to regenerate


def test_generation_runs_with_sdpa_and_capture_keeps_its_attention(tiny, tokenizer, tmp_path):
    """Generation always runs with the decoding core's sdpa (flex attention under generate()
    failed to compile on an H200: docs/BENCHMARKS.md), and the packed capture goes back to the producer's own
    attention, with the same hidden states as before."""
    target = load_target(str(tiny), None, device=CPU, full=True, attn_impl="eager")
    seen: list[str] = []
    attn = target.layers[0].self_attn
    hook = attn.register_forward_pre_hook(lambda m, a: seen.append(m.config._attn_implementation))
    ids = torch.tensor(tokenizer("Count from 1 to 9.")["input_ids"])
    pos = torch.arange(ids.numel())
    before = target.capture(ids, pos)
    assert seen == ["eager"]
    seen.clear()
    regen = Regenerator(target, tokenizer, RegenCache(tmp_path, cache_key("fp-attn", target, tokenizer, NEW, {})),
                        max_new_tokens=NEW, batch_size=2)
    regen.apply([Row(0, "d:0", messages=CHAT)])
    from dflash.decoding.attention import decode_attention

    assert seen and set(seen) == {decode_attention(target.model)} and seen[0] in ("decoding_core", "sdpa")
    seen.clear()
    after = target.capture(ids, pos)
    hook.remove()
    assert seen == ["eager"] and target.info.attn_impl == "eager"
    assert torch.equal(before, after)


def test_batched_greedy_loop_equals_generate_row_by_row(tiny, tokenizer, reference):
    """The decoding core's batched greedy generation (decoding/greedy.py) gives every row, in
    a batch of different lengths, exactly what HF generate() gives for that row alone,
    stopping each row at its own first stop token."""
    from dflash.decoding.greedy import greedy_generate

    target = load_target(str(tiny), None, device=CPU, full=True)
    prompts = [tokenizer(t)["input_ids"] for t in ("Count from 1 to 9.", "Hi", "What is the capital of a country?")]
    free = [reference_greedy(reference, p, 12, set()) for p in prompts]
    stops = {free[1][3]}  # row 1 must stop early, at its 4th token; the others go on unless they emit it too
    got = greedy_generate(target.model, prompts, max_new_tokens=12, stop_ids=stops, batch_size=len(prompts))
    want = [reference_greedy(reference, p, 12, stops) for p in prompts]
    assert got == want
    assert len(got[1]) <= 4 and got[1][-1] in stops
    assert greedy_generate(target.model, prompts, max_new_tokens=1, stop_ids=stops, batch_size=len(prompts)) == \
        [w[:1] for w in want]


def test_more_conversations_than_rows_are_continuously_batched_and_exact(tiny, tokenizer, reference, tmp_path):
    """Two rows for five conversations of one to three turns: a row whose turn ended takes
    the next waiting turn (another conversation's or its own next one) while the other row
    is mid-turn; every span is still exactly the reference greedy output after its prefix."""
    target = load_target(str(tiny), None, device=CPU, full=True)
    chats = [c["messages"] for c in generate_chats()[:5]]
    chats[1] = CHAT + [{"role": "user", "content": "And to 5?"}, {"role": "assistant", "content": "1 2 3 4 5"}]
    regen = Regenerator(target, tokenizer, RegenCache(tmp_path, "cb"), max_new_tokens=9, batch_size=2)
    new = regen.apply([Row(i, f"d:{i}", messages=m) for i, m in enumerate(chats)])
    stops = stop_ids(reference, tokenizer)
    for row, msgs in zip(new, chats):
        turns = spans(row.loss_mask)
        assert len(turns) == sum(m["role"] == "assistant" for m in msgs)
        for a, b in turns:
            assert row.input_ids[a:b] == reference_greedy(reference, row.input_ids[:a], 9, stops)
    assert len(spans(new[1].loss_mask)) == 3


def test_a_prompt_without_an_answer_is_answered_by_the_target_and_refused_without_regenerate(tiny, tokenizer, reference,
                                                                                             tmp_path):
    """A chat ending in a user turn (prompts only, the usual data for regeneration) gets its
    answer from the target: exactly the IDs and mask of the same chat with a placeholder
    answer. Without --regenerate it is a bad row that says what to do."""
    from dflash.producers.data import BadRow, parse_record

    prompt = parse_record({"messages": CHAT[:1]}, 0, "d:1")
    answered = parse_record({"messages": CHAT[:2]}, 1, "d:2")
    target = load_target(str(tiny), None, device=CPU, full=True)
    regen = Regenerator(target, tokenizer, RegenCache(tmp_path, cache_key("fp0", target, tokenizer, NEW, {})),
                        max_new_tokens=NEW, batch_size=2)
    new = regen.apply([prompt, answered])
    check_exact(new[0], reference, tokenizer, 1, NEW)
    assert (new[0].input_ids, new[0].loss_mask) == (new[1].input_ids, new[1].loss_mask)
    assert [m["role"] for m in new[0].messages] == ["user", "assistant"] and new[0].messages[1]["content"]
    try:
        ChatEncoder(tokenizer, 4096).encode(prompt)
    except BadRow as e:
        assert "no assistant turn" in str(e) and "--regenerate" in str(e)
    else:
        raise AssertionError("a prompt without an answer was encoded without --regenerate")
    with __import__("pytest").raises(BadRow, match="no assistant turn"):  # nothing to answer: a system turn last
        parse_record({"messages": [{"role": "system", "content": "x"}]}, 2, "d:3")


def test_decoder_prompt_room_holds_a_next_turn_only_where_one_comes():
    """With sdpa every decode step attends each row's whole page table, so a decoder is
    sized for the longest prompt (rounded up to 64) plus one answer only when a
    conversation has a turn after the one being decoded."""
    from types import SimpleNamespace

    from dflash.decoding.greedy import Job
    from dflash.producers.regenerate import Regenerator

    regen = SimpleNamespace(max_new_tokens=256)
    slots = Regenerator.prompt_slots.__get__(regen)
    single = SimpleNamespace(generated=[], turns=[1])
    two_turns = SimpleNamespace(generated=[], turns=[1, 3])
    on_last = SimpleNamespace(generated=[[5]], turns=[1, 3])
    jobs = [Job(single, [0] * 70), Job(on_last, [0] * 20)]
    assert slots(jobs, lambda j: j.key) == 128
    assert slots([Job(single, [0] * 64)], lambda j: j.key) == 64
    assert slots(jobs + [Job(two_turns, [0] * 10)], lambda j: j.key) == 384  # 70 + 256, rounded up


def test_rows_sized_by_memory_unless_given(tiny, tokenizer, tmp_path):
    """--regen-batch-size 0 plans each decoder's paged KV cache (on a CPU: CPU_ROWS rows,
    fewer for fewer jobs, and pages for all of them at full length) and logs the plan; a
    given size is kept; a negative size is refused."""
    from dflash.producers.regenerate import CPU_PAGE_SLOTS, CPU_ROWS, kv_plan

    tiny = load_target(str(tiny), None, device=CPU, full=True)
    cache = RegenCache(tmp_path, "k")
    auto = Regenerator(tiny, tokenizer, cache, max_new_tokens=NEW, batch_size=0)
    given = Regenerator(tiny, tokenizer, cache, max_new_tokens=NEW, batch_size=7)
    assert auto.batch_size == CPU_ROWS and given.batch_size == 7
    assert not auto.graphed_prefill  # graphed packs only on a GPU
    width = -(-(64 + 30) // CPU_PAGE_SLOTS)
    assert kv_plan(tiny.model, CPU, 0, 100, 64, 30) == {"source": "memory", "max_prompt": 64, "page_size": CPU_PAGE_SLOTS,
                                                         "rows": CPU_ROWS, "pages": CPU_ROWS * width}
    assert kv_plan(tiny.model, CPU, 0, 3, 64, 30)["rows"] == 3
    plan = kv_plan(tiny.model, CPU, 7, 100, 64, 30)
    assert plan["rows"] == 7 and plan["source"] == "--regen-batch-size" and plan["pages"] == 7 * width
    with capture_logs() as logs:
        auto.apply([Row(0, "d:0", messages=CHAT)])
    said = [e for e in logs if e["event"] == "produce.regen_rows"]
    assert said and said[0]["rows"] == 1 and said[0]["source"] == "memory" and said[0]["jobs"] == 1
    assert said[0]["pages"] >= -(-(said[0]["max_prompt"] + NEW) // CPU_PAGE_SLOTS)
    with pytest.raises(ValueError, match="0 .sized by memory. or more"):
        Regenerator(tiny, tokenizer, cache, max_new_tokens=NEW, batch_size=-1)


def test_a_gpu_plan_takes_its_share_of_the_gpu_not_what_is_free(tiny, monkeypatch):
    """On a GPU the pages come from the plan (AUTO_KV_FRACTION of the GPU's memory), cut to
    half the free memory only where that is less; never fewer than one longest job needs.
    No GPU here: the memory query answers as a GPU's would (kv_plan reads nothing else)."""
    from dflash.decoding.core import kv_bytes_per_slot
    from dflash.producers.regenerate import AUTO_KV_FRACTION, AUTO_ROWS_CAP, PAGE_SLOTS, kv_plan

    model = load_target(str(tiny), None, device=CPU, full=True).model
    per_page = kv_bytes_per_slot(model, model.dtype) * PAGE_SLOTS
    total = 1000 * per_page
    gpu = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(0.95 * total), total))
    plan = kv_plan(model, gpu, 0, 10_000, 256, 128)
    assert plan["kv_fraction"] == AUTO_KV_FRACTION and plan["kv_plan_bytes"] == int(total * AUTO_KV_FRACTION)
    assert plan["pages"] == int(total * AUTO_KV_FRACTION) // per_page - 1 and not plan["capped_by_free"]
    assert plan["kv_bytes"] <= plan["kv_plan_bytes"] and plan["rows"] == min(AUTO_ROWS_CAP, plan["pages"])
    # a drafter already holds most of the GPU: half of what is free
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total // 4, total))
    plan = kv_plan(model, gpu, 64, 10_000, 256, 128)
    assert plan["capped_by_free"] and plan["kv_bytes"] <= total // 8 and plan["rows"] == 64
    # too little for one longest job: that job's pages all the same
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (per_page, total))
    assert kv_plan(model, gpu, 0, 10, 4096, 1024)["pages"] == -(-(4096 + 1024) // PAGE_SLOTS)
