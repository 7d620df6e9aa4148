"""Which vocabulary row the drafter's block MASK uses, for any target (docs/TRAINING.md
"The MASK token").

It must be a row the drafter never sees as a real token, and not pad/eos/bos/unk (the drafter
would be told "end of text" at every drafted position). Rules, first match wins: the
tokenizer's mask token, the first row past the tokenizer, a reserved special, an unused special
the template never emits; an explicit --mask-token-id wins, warned about if unsafe, never refused."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dflash.runtime import targets
from dflash.runtime.logs import get_logger
from dflash.runtime.target_heads import TargetHeads

log = get_logger()

MASK_NAMES = ("<|mask|>", "<mask>", "[MASK]", "<|MASK|>")
RESERVED = re.compile(r"reserved|unused", re.IGNORECASE)
QWEN3_FREE_ROW = 151669  # Qwen3's first row past its tokenizer (151669 tokens, 151936 rows)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# rendered through the chat template: a candidate it emits is refused
_PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
          {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]


@dataclass(frozen=True)
class MaskChoice:
    token_id: int
    token: str | None  # its text; None for a row no text encodes to
    rule: str  # explicit | tokenizer_mask | beyond_tokenizer | reserved | unused_special | qwen3_default
    reason: str
    warnings: tuple[str, ...] = ()  # an explicit choice's problems

    def as_dict(self) -> dict:
        d = asdict(self)
        d["warnings"] = list(self.warnings)
        return d


def mask_choice(heads: TargetHeads, explicit: int | None = None) -> MaskChoice:
    """The MASK row for `heads` (chosen and logged once per target); ValueError if no rule finds one."""
    if explicit in heads.mask_choices:
        return heads.mask_choices[explicit]
    V = heads.spec.vocab_size
    if explicit is not None and not 0 <= explicit < V:
        raise ValueError(f"mask token id {explicit} outside the vocabulary (0..{V - 1})")
    facts = _Facts(heads)
    if explicit is not None:
        problems = tuple(facts.problems(explicit))
        choice = MaskChoice(explicit, facts.text(explicit), "explicit", "--mask-token-id", problems)
    else:
        choice = _automatic(facts, heads)
    heads.mask_choices[explicit] = choice
    log.info("train.mask_token", mask_token_id=choice.token_id, token=choice.token, rule=choice.rule,
             reason=choice.reason, specials=facts.special_ids())
    if choice.warnings:
        log.warning("train.mask_token_unsafe", mask_token_id=choice.token_id, token=choice.token,
                    problems=list(choice.warnings))
    return choice


def _automatic(facts: "_Facts", heads: TargetHeads) -> MaskChoice:
    tok, V = facts.tok, heads.spec.vocab_size
    if tok is None:
        if heads.spec.model_type.startswith("qwen3") and V > QWEN3_FREE_ROW:
            return MaskChoice(QWEN3_FREE_ROW, None, "qwen3_default",
                              "no tokenizer files; Qwen3's first row past its 151669-token tokenizer")
        raise ValueError(f"no tokenizer in {heads.path} to choose the MASK row from: pass --mask-token-id "
                         "(a vocabulary row the data never contains, not pad/eos/bos/unk)")
    for tid, why in facts.mask_tokens():
        if not facts.problems(tid):
            return MaskChoice(tid, facts.text(tid), "tokenizer_mask", why)
    if V > len(tok) and not facts.problems(len(tok)):
        return MaskChoice(len(tok), None, "beyond_tokenizer",
                          f"first of the {V - len(tok)} embedding rows past the {len(tok)}-token tokenizer: "
                          "no text encodes to it")
    added = facts.added_specials()
    for tid, text in added:
        if RESERVED.search(text) and not facts.problems(tid):
            return MaskChoice(tid, text, "reserved", f"special token {text!r} is reserved (named reserved/unused)")
    for tid, text in reversed(added):
        if not facts.problems(tid):
            return MaskChoice(tid, text, "unused_special",
                              f"special token {text!r}: not pad/eos/bos/unk, never emitted by the chat template "
                              "(highest such ID)")
    raise ValueError(f"no free vocabulary row for MASK in {heads.path}: the tokenizer has no mask, reserved or "
                     "unused special token and no rows past its length; pass --mask-token-id with a token the "
                     "data never contains")


class _Facts:
    """What the checks need of the target: its tokenizer (or None), special IDs, template."""

    def __init__(self, heads: TargetHeads):
        self.heads, self.tok = heads, _tokenizer(heads.path)
        self.specials: dict[str, set[int]] = {k: set() for k in ("pad", "eos", "bos", "unk")}
        for k in self.specials:
            v = heads.config.get(f"{k}_token_id")
            self.specials[k].update(v if isinstance(v, list) else [v] if isinstance(v, int) else [])
            tid = getattr(self.tok, f"{k}_token_id", None) if self.tok is not None else None
            if isinstance(tid, int):
                self.specials[k].add(tid)
        self.template = ""
        if self.tok is not None and isinstance(getattr(self.tok, "chat_template", None), str):
            self.template = self.tok.chat_template
            try:
                self.template += self.tok.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True)
            except Exception:  # a template that needs other roles: its source text is still checked
                pass

    def special_ids(self) -> dict:
        return {k: sorted(v) for k, v in self.specials.items()}

    def text(self, tid: int) -> str | None:
        if self.tok is None or tid >= len(self.tok):
            return None
        return self.tok.convert_ids_to_tokens(tid)

    def mask_tokens(self) -> list[tuple[int, str]]:
        out = []
        if self.tok.mask_token is not None and isinstance(self.tok.mask_token_id, int):
            out.append((self.tok.mask_token_id, f"the tokenizer's mask_token {self.tok.mask_token!r}"))
        for tid, text in self.added_specials(special_only=False):
            if text in MASK_NAMES:
                out.append((tid, f"the tokenizer's added token {text!r}"))
        return out

    def added_specials(self, special_only: bool = True) -> list[tuple[int, str]]:
        dec = getattr(self.tok, "added_tokens_decoder", {}) or {}
        return sorted((int(i), str(t.content)) for i, t in dec.items()
                      if (getattr(t, "special", False) or not special_only) and int(i) < self.heads.spec.vocab_size)

    def problems(self, tid: int) -> list[str]:
        """Why `tid` is not a safe MASK row (empty: safe as far as the target shows)."""
        out = []
        embed = self.heads.embed
        text = self.text(tid)
        for kind, ids in self.specials.items():
            for s in ids:
                if not 0 <= s < embed.shape[0]:
                    continue
                if s == tid:
                    out.append(f"it is the {kind} token")
                elif text is not None and text == self.text(s):
                    out.append(f"its text {text!r} is the {kind} token's")
                elif torch.equal(embed[tid], embed[s]):
                    out.append(f"its embedding row equals the {kind} token's ({s})")
        added = {t for _, t in self.added_specials(special_only=False)}
        if text in added and self.template and text in self.template:
            out.append(f"the chat template emits {text!r}")
        return out


def _tokenizer(path: str):
    if targets.gguf_path(path) is None and not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        return None
    try:
        tok = targets.load_tokenizer(path)
    except (OSError, ValueError) as e:
        log.warning("train.tokenizer_unreadable", target=str(path), error=f"{type(e).__name__}: {e}")
        return None
    return tok if len(tok) >= 2 else None  # transformers makes an empty one for a folder without files


def mask_in_batch(input_ids: torch.Tensor, mask_token_id: int) -> int:
    return int((input_ids == mask_token_id).sum())
