"""Rows -> token IDs + loss mask, through the target tokenizer's own chat template.

The mask is 1 on what the model emits in an assistant turn (content and end marker, not the
header), found from prefix renders without knowing the template's markup; the conversation is
tokenised once and spans mapped by offsets, so the IDs are exactly the template's."""

from __future__ import annotations

from dataclasses import dataclass

from .data import BadRow, Row

_PROBE = "\u2063dflash-probe\u2063"  # invisible separator: never in real text


@dataclass
class Encoded:
    sample: int
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False


class ChatEncoder:
    """Tokenise rows with `tokenizer`'s chat template; truncate to `max_length` tokens."""

    def __init__(self, tokenizer, max_length: int, template_kwargs: dict | None = None):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer: the loss mask "
                             "needs character offsets (use a tokenizer.json checkpoint)")
        self.tok = tokenizer
        self.max_length = max_length
        self.kw = dict(template_kwargs or {})
        # A base model without a template can still read plain-text rows.
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.end_marker = self._probe_end_marker() if self.has_template else ""

    def _render(self, messages: list[dict], gen: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **self.kw)

    def _probe_end_marker(self) -> str:
        """What the template writes after an assistant's content (e.g. '<|im_end|>'), stripped."""
        text = self._render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}], False)
        return text[text.rindex(_PROBE) + len(_PROBE):].strip()

    def encode(self, row: Row) -> Encoded:
        """Token IDs and loss mask of `row`. Raises BadRow if its template render fails."""
        if row.input_ids is not None:
            # a regenerated chat: re-tokenising decoded text is lossy
            return self._truncate(row.sample, row.input_ids, row.loss_mask)
        if row.text is not None:
            ids = self.tok(row.text, add_special_tokens=True)["input_ids"]
            return self._truncate(row.sample, ids, [1] * len(ids))
        if not self.has_template:
            raise ValueError(f"{row.source}: chat row, but the tokenizer has no chat_template")
        if not any(m["role"] == "assistant" for m in row.messages):
            raise BadRow(row.sample, row.source, "a prompt without an answer (no assistant turn): nothing to learn "
                         "from; give --regenerate to have the target answer it")
        try:
            full = self._render(row.messages, False)
            spans = self._assistant_spans(row.messages, full)
        except BadRow:
            raise
        except Exception as e:  # jinja raises TemplateError for e.g. non-alternating roles
            raise BadRow(row.sample, row.source, f"chat template failed: {type(e).__name__}: {e}") from None
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        mask = _mask_from_spans(enc["offset_mapping"], spans)
        return self._truncate(row.sample, enc["input_ids"], mask)

    def _truncate(self, sample: int, ids: list[int], mask: list[int]) -> Encoded:
        cut = len(ids) > self.max_length
        return Encoded(sample, list(ids[: self.max_length]), list(mask[: self.max_length]), cut)

    def _assistant_spans(self, messages: list[dict], full: str) -> list[tuple[int, int]]:
        """Character spans [start, end) of the assistant turns in `full`."""
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = cursor
            prompt = self._render_or_none(messages[:i], True)
            if prompt is not None and full.startswith(prompt) and len(prompt) >= cursor:
                start = len(prompt)
            upto = self._render_or_none(messages[: i + 1], False)
            if upto is not None and full.startswith(upto) and len(upto) > start:
                end = len(upto)
            else:
                end = self._find_turn_end(full, m["content"], start, i)
            while end > start and full[end - 1].isspace():  # "\n" after <|im_end|> is template
                end -= 1
            spans.append((start, end))
            cursor = end
        return spans

    def _render_or_none(self, messages: list[dict], gen: bool) -> str | None:
        if not messages:
            return None
        try:
            return self._render(messages, gen)
        except Exception:  # some templates refuse partial chats (e.g. no user turn yet)
            return None

    def _find_turn_end(self, full: str, content: str, start: int, i: int) -> int:
        body = content.strip()
        j = full.find(body, start)
        if j < 0:
            raise ValueError(f"the chat template does not render assistant turn {i} verbatim; "
                             "cannot locate it for the loss mask")
        end = j + len(body)
        k = end
        while k < len(full) and full[k].isspace() and not full.startswith(self.end_marker, k):
            k += 1
        if self.end_marker and full.startswith(self.end_marker, k):
            end = k + len(self.end_marker)
        return end


def _mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token whose first character lies inside a span (both sorted)."""
    mask = [0] * len(offsets)
    s = 0
    for t, (a, b) in enumerate(offsets):
        while s < len(spans) and spans[s][1] <= a:
            s += 1
        if s == len(spans):
            break
        if spans[s][0] <= a < spans[s][1] and b > a:
            mask[t] = 1
    return mask
