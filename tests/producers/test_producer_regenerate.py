"""--regenerate: assistant turns become the target's own greedy output, turn by turn, and
are cached on disk so an epoch 2 or a restart does not generate again."""

from __future__ import annotations

import torch

from dflash.producers.data import Row
from dflash.producers.regenerate import RegenCache, Regenerator, cache_key
from dflash.producers.target import load_target

CPU = torch.device("cpu")
CHAT = [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Count to 3."}, {"role": "assistant", "content": "1 2 3"}]


def greedy(model, tok, messages, n):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_regenerated_turns_are_the_targets_greedy_output_and_cached(tiny, tokenizer, reference, tmp_path):
    target = load_target(str(tiny), None, device=CPU, full=True)
    key = cache_key("fp0", target, tokenizer, 6, {})
    regen = Regenerator(target, tokenizer, RegenCache(tmp_path, key), max_new_tokens=6, batch_size=4)
    rows = [Row(0, "d:1", messages=CHAT), Row(1, "d:2", messages=CHAT[:2]), Row(2, "d:3", text="plain")]
    new = regen.apply(rows)

    first = greedy(reference, tokenizer, CHAT[:1], 6)
    second = greedy(reference, tokenizer, [CHAT[0], {"role": "assistant", "content": first}, CHAT[2]], 6)
    assert [m["content"] for m in new[0].messages] == [CHAT[0]["content"], first, CHAT[2]["content"], second]
    assert [m["content"] for m in new[1].messages] == [CHAT[0]["content"], first]
    assert new[2].text == "plain"
    assert regen.generated == 2 and regen.cache_hits == 0

    # A restarted producer (new objects, same cache folder and key) generates nothing.
    again = Regenerator(target, tokenizer, RegenCache(tmp_path, key), max_new_tokens=6)
    assert again.apply(rows)[0].messages == new[0].messages
    assert again.generated == 0 and again.cache_hits == 2
    # Other settings are another cache.
    assert cache_key("fp0", target, tokenizer, 7, {}) != key
    assert cache_key("fp1", target, tokenizer, 6, {}) != key


def test_capture_is_unaffected_by_a_full_model(tiny, target):
    full = load_target(str(tiny), None, device=CPU, full=True)
    ids = torch.arange(20)
    torch.testing.assert_close(full.capture(ids, torch.arange(20)), target.capture(ids, torch.arange(20)))
