"""Loss mask: 1 exactly on the assistant tokens (content + end-of-turn marker) of every
turn of a multi-turn chat, through each family's real chat template."""

from __future__ import annotations

import pytest

from dflash.producers.chat import ChatEncoder
from dflash.producers.data import BadRow, Row

pytestmark = pytest.mark.unit

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 3 plus 4?"},
    {"role": "assistant", "content": "3 plus 4 is 7."},
    {"role": "user", "content": "Say 3 plus 4 is 7 again."},  # assistant text inside a user turn
    {"role": "assistant", "content": "3 plus 4 is 7."},
    {"role": "user", "content": "Count to 3."},
    {"role": "assistant", "content": "1 2 3"},
]

# Renders the last assistant turn with an empty think block, like Qwen3's real template:
# not prefix-stable, so the encoder's fallback path is exercised.
QWEN3_LIKE = (
    "{%- for m in messages %}{%- if m.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def masked_runs(tok, ids: list[int], mask: list[int]) -> list[str]:
    """The text of each contiguous run of loss-carrying tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def test_mask_covers_exactly_the_assistant_turns(tokenizer):
    enc = ChatEncoder(tokenizer, max_length=4096).encode(Row(0, "x:1", messages=CHAT))
    eot = tokenizer.eos_token  # <|im_end|> for the Qwen tiny, <|eot_id|> for the Llama one
    assert masked_runs(tokenizer, enc.input_ids, enc.loss_mask) == [
        f"3 plus 4 is 7.{eot}", f"3 plus 4 is 7.{eot}", f"1 2 3{eot}"]
    # The IDs are exactly the template's own tokenisation of the whole chat.
    full = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert enc.input_ids == tokenizer(full, add_special_tokens=False)["input_ids"]
    assert len(enc.loss_mask) == len(enc.input_ids) and not enc.truncated


def test_template_that_renders_the_last_turn_differently(tokenizer):
    if tokenizer.eos_token != "<|im_end|>":
        pytest.skip("ChatML markup")
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = QWEN3_LIKE
    enc = ChatEncoder(tok, max_length=4096).encode(Row(0, "x:1", messages=CHAT))
    # What the model emits after the generation prompt, think block included.
    assert masked_runs(tok, enc.input_ids, enc.loss_mask) == [
        "3 plus 4 is 7.<|im_end|>", "3 plus 4 is 7.<|im_end|>", "<think>\n\n</think>\n\n1 2 3<|im_end|>"]


def test_truncation_and_text_rows(tokenizer):
    encoder = ChatEncoder(tokenizer, max_length=12)
    enc = encoder.encode(Row(0, "x:1", messages=CHAT))
    assert len(enc.input_ids) == 12 and enc.truncated
    text = ChatEncoder(tokenizer, max_length=4096).encode(Row(1, "x:2", text="3 plus 4 is 7."))
    assert text.input_ids and all(text.loss_mask)


def test_template_failure_is_a_bad_row(tokenizer):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = ("{%- for m in messages %}{%- if m.role == 'system' %}"
                         "{{ raise_exception('system turns unsupported') }}{%- endif %}"
                         "{{- m.content }}{%- endfor %}")
    with pytest.raises(BadRow, match=r"^f\.jsonl:7: chat template failed: .*system turns unsupported"):
        ChatEncoder(tok, 4096).encode(Row(6, "f.jsonl:7", messages=CHAT))
