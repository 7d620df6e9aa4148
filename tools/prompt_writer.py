"""The target writes user requests of chosen task families (`dflash-prompts`' engine).

An instruction-tuned model given the opening of a user turn in its own chat template writes
a user request of the kind it was tuned on (the "Magpie" method). Left alone it writes
narrow chat; steered through the template it writes requests of a family
(prompt_families.py), by one of the methods measured in bench/prompt_steering.py:

- `opening` (the default, the measurement's winner: docs/TRAINING.md "Data"): the user turn
  is pre-filled with a family's first words, and the request is those words plus what the
  target writes after them;
- `system`: a system prompt describes the user; `seeds`: a system prompt shows three
  example requests of the family; `none`: no steering (the families are labels only).

The steering text is never part of a written row: a row holds the user's request (the
opening included) and, for a follow-up, the first request and the target's greedy answer
to it, as `--regenerate` will answer (it writes the answers again anyway).

Follow-up rows take three decodes: a first request (of another family, steered the same
way), the target's answer (greedy, at most `answer_tokens`; a cut answer is kept as the
context and counted), then the follow-up request after it. Decoding is batched on the
decoding core (decoding/greedy.py: GreedyDecoder with a Sampler; the answers greedy).

Every candidate is judged: kept only if the target ended the turn itself, wrote something
(after the opening), wrote no chat markup, matches no `exclude` pattern and is not a
near-duplicate of a prompt kept before (near_dup.py; a follow-up row is compared by its two
requests together). Rejections are counted per family and reason.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from .near_dup import THRESHOLD, NearDupIndex
from .prompt_families import FAMILIES, Family

STEERS = ("opening", "system", "seeds", "none")
_MARK = "\x00DFLASH-USER-TURN\x00"


class PromptError(ValueError):
    """The target or its template cannot write prompts this way, or wrote too few."""


# ---------------------------------------------------------------- the template


def turn_prefix(tokenizer, messages: list[dict]) -> str:
    """The template's text after `messages`, up to where the next user message's content
    starts (a system prompt the template adds by default included)."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("the target's tokenizer has no chat template: it cannot be asked to write a user turn")
    try:
        text = tokenizer.apply_chat_template(messages + [{"role": "user", "content": _MARK}], tokenize=False)
    except Exception as e:  # jinja raises its own errors, e.g. "System role not supported"
        roles = [m["role"] for m in messages]
        raise PromptError(f"the chat template cannot render turns {roles} ({type(e).__name__}: {e}); "
                          "--steer opening needs no system prompt") from None
    if text.count(_MARK) != 1:
        raise PromptError("the chat template does not copy a user message verbatim: "
                          "cannot find where a user turn starts")
    return text.split(_MARK)[0]


def user_turn(tokenizer) -> tuple[str, str]:
    """(the template's text before a first user message, the text right after it)."""
    before = turn_prefix(tokenizer, [])
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
    return before, text.split(_MARK)[1]


def turn_end_ids(tokenizer, after: str, eos: set[int]) -> set[int]:
    """What ends a user turn: the special token the template puts right after the message
    (e.g. <|im_end|>, <|eot_id|>, <end_of_turn>), and the model's end-of-sequence IDs."""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    ends = set(eos)
    if ids and ids[0] in special:
        ends.add(ids[0])
    if not ends:
        raise PromptError("found no token that ends a user turn (no special token after the message, no eos)")
    return ends


def steering(steer: str, family: Family, rng: random.Random) -> tuple[list[dict], str]:
    """(messages to put before the conversation, words to pre-fill the user turn with)."""
    if steer == "opening":
        return [], family.opening(rng)
    if steer == "system":
        return [{"role": "system", "content": family.describe}], ""
    if steer == "seeds":
        shown = "\n".join(f"- {s}" for s in family.seed_examples(rng))
        return [{"role": "system", "content": "Here are examples of requests users send to an AI assistant:\n"
                 f"{shown}\nWrite one new request of this kind, as the user."}], ""
    if steer == "none":
        return [], ""
    raise PromptError(f"unknown steering {steer!r}; choose from {', '.join(STEERS)}")


# ---------------------------------------------------------------- judging


def judge(written: str, ended: bool, markup: list[str], exclude: list[re.Pattern], full: str) -> str | None:
    """Why a request is rejected (`written`: what the target wrote; `full`: the request,
    opening included), or None to keep it, near-duplicates aside."""
    if not ended:
        return "unfinished"  # hit the token limit before the turn ended: a cut request
    if not written:
        return "empty"  # the target ended the turn at once (after the opening, if any)
    if any(m in written for m in markup):
        return "markup"  # the model wrote past its turn into the template's tags
    if any(p.search(full) for p in exclude):
        return "excluded"
    return None


@dataclass
class Written:
    """One kept row: the family and its turns ([user] or [user, assistant, user])."""

    family: str
    messages: list[dict]
    answer_cut: bool = False  # follow-up: the answer it follows hit answer_tokens
    opening: str = ""  # the words the last user turn was pre-filled with (steering `opening`)

    def key(self) -> str:
        """What near-duplicates are judged on: the user turns, together."""
        return "\n".join(m["content"] for m in self.messages if m["role"] == "user")


@dataclass
class FamilyTally:
    """What happened to a family's candidates: kept (in order), or why not."""

    kept: list[Written] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    tried: int = 0
    answers_cut: int = 0  # kept follow-ups whose answer was cut


@dataclass
class _Candidate:
    family: Family
    lead: list[dict]  # the steering messages (never written out)
    opening: str
    turns: list[dict] = field(default_factory=list)  # the conversation so far
    answer_cut: bool = False


# ---------------------------------------------------------------- the writer


class PromptWriter:
    """Writes rows of families on `model` (see the module docstring); `write` is one call."""

    def __init__(self, model, tokenizer, *, steer: str = "opening", max_new_tokens: int = 128,
                 answer_tokens: int = 256, temperature: float = 1.0, top_k: int = 0, rows: int = 256,
                 exclude: list[str] = (), near_dup: float = THRESHOLD, seed: int = 0):
        from dflash.producers.regenerate import stop_ids

        if steer not in STEERS:
            raise PromptError(f"unknown steering {steer!r}; choose from {', '.join(STEERS)}")
        self.model, self.tok, self.steer = model, tokenizer, steer
        self.max_new, self.answer_tokens, self.rows = max_new_tokens, answer_tokens, rows
        self.temperature, self.top_k = temperature, top_k
        _, after = user_turn(tokenizer)
        self.eos = stop_ids(model, tokenizer)
        self.ends = turn_end_ids(tokenizer, after, self.eos)
        self.markup = [t for t in tokenizer.all_special_tokens if len(t) > 1]
        self.exclude = [re.compile(p, re.IGNORECASE) for p in exclude]
        self.index = NearDupIndex(near_dup)
        self.rng = random.Random(seed)
        self.seed = seed
        self._decoders: dict[str, tuple] = {}  # kind -> (decoder, its longest prompt, its rows)
        self._on_decoded: Callable[[str], None] | None = None

    # ------------------------------------------------ decoding

    def _decode(self, kind: str, jobs: list[tuple[object, list[int]]], done: Callable[[object, list[int]], None]):
        """Decode `jobs` (key, prompt IDs) on the decoder of `kind` (ask/follow: sampled,
        answer: greedy), made or grown to fit the longest prompt."""
        from dflash.decoding.greedy import GreedyDecoder, Job, Sampler

        if not jobs:
            return
        need, rows = max(len(p) for _, p in jobs), min(self.rows, len(jobs))
        dec, room, width = self._decoders.get(kind, (None, 0, 0))
        if room < need or width < rows:
            self._decoders.pop(kind, None)
            dec = None  # free its cache before making the next
            greedy = kind == "answer"
            room, width = 64 * math.ceil(need / 64), rows
            dec = GreedyDecoder(self.model, rows=width, max_prompt=room,
                                max_new_tokens=self.answer_tokens if greedy else self.max_new,
                                stop_ids=self.eos if greedy else self.ends,
                                pick=None if greedy else Sampler(self.temperature, self.top_k))
            self._decoders[kind] = (dec, room, width)
        def finished(job, out: list[int]) -> None:
            done(job.key, out)
            if self._on_decoded is not None:
                self._on_decoded(kind)

        dec.run(deque(Job(k, p) for k, p in jobs), finished)

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _ask_job(self, c: _Candidate) -> list[int]:
        return self._ids(turn_prefix(self.tok, c.lead + c.turns) + c.opening)

    def _request(self, c: _Candidate, out: list[int]) -> tuple[str | None, str]:
        """(why the request `out` is rejected or None, the request's text)."""
        ended = bool(out) and out[-1] in self.ends
        written = self.tok.decode(out[:-1] if ended else out, skip_special_tokens=False)
        full = (c.opening + written).strip()
        return judge(written.strip(), ended, self.markup, self.exclude, full), full

    # ------------------------------------------------ rounds

    def write(self, wants: dict[str, int], *, max_tries: int | None = None,
              on_kept: Callable[[str, dict[str, FamilyTally]], None] | None = None,
              on_decoded: Callable[[str], None] | None = None) -> dict[str, FamilyTally]:
        """At least `wants[family]` rows of each family, in as few candidates as it takes, at
        most `max_tries` (default 4 x the rows wanted). Raises PromptError when a family falls
        short. `on_kept(family, tallies)` is called for every row kept, `on_decoded(kind)` for
        every sequence decoded (kind: ask, answer or follow): progress moves with the work,
        which for a follow-up is three decodes before a row can be kept."""
        self._on_decoded = on_decoded
        import torch

        unknown = sorted(set(wants) - set(FAMILIES))
        if unknown:
            raise PromptError(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
        if any(n < 0 for n in wants.values()) or sum(wants.values()) < 1:
            raise PromptError(f"rows wanted {wants}: none negative, at least one")
        max_tries = max_tries or 4 * sum(wants.values())
        torch.manual_seed(self.seed)
        tallies = {name: FamilyTally() for name in wants}
        tried = 0
        while tried < max_tries:
            missing = {n: w - len(tallies[n].kept) for n, w in wants.items() if len(tallies[n].kept) < w}
            if not missing:
                break
            plan = self._plan(missing, max_tries - tried)
            tried += len(plan)
            for c in plan:
                tallies[c.family.name].tried += 1
            self._round(plan, tallies, on_kept)
        short = {n: f"{len(tallies[n].kept)}/{w}" for n, w in wants.items() if len(tallies[n].kept) < w}
        if short:
            raise PromptError(f"the target wrote too few usable prompts in {tried} candidates: {short} (kept/wanted); "
                              f"rejected: { {n: dict(t.dropped) for n, t in tallies.items()} }; raise --max-tries "
                              "or --max-new-tokens, or ask for fewer")
        return tallies

    def _plan(self, missing: dict[str, int], budget: int) -> list[_Candidate]:
        """This round's candidates: what each family still misses, with headroom for
        rejections (and enough to fill the decoder's rows), interleaved, within `budget`."""
        total = sum(missing.values())
        scale = max(1.25, self.rows / total)
        counts = {n: math.ceil(m * scale) for n, m in missing.items()}
        order: list[str] = []
        while any(counts.values()):
            for n in counts:
                if counts[n]:
                    order.append(n)
                    counts[n] -= 1
        plan = []
        for n in order[:budget]:
            fam = FAMILIES[n]
            base = FAMILIES[self.rng.choice([f for f in FAMILIES if not FAMILIES[f].follow_up])] if fam.follow_up \
                else fam
            lead, opening = steering(self.steer, base, self.rng)
            plan.append(_Candidate(fam, lead, opening))
        return plan

    def _round(self, plan: list[_Candidate], tallies: dict[str, FamilyTally], on_kept) -> None:
        """Decode the round's requests; follow-up candidates go on to an answer and a second request."""
        answering: list[_Candidate] = []

        def settle(c: _Candidate, why: str | None, text: str) -> None:
            t = tallies[c.family.name]
            if why is None:
                row = Written(c.family.name, c.turns + [{"role": "user", "content": text}], c.answer_cut, c.opening)
                if self.index.keep(row.key()) is not None:
                    why = "near_duplicate"
                else:
                    t.kept.append(row)
                    t.answers_cut += row.answer_cut
                    if on_kept is not None:
                        on_kept(c.family.name, tallies)
                    return
            t.dropped[why] += 1

        def asked(i: int, out: list[int]) -> None:
            c = plan[i]
            why, text = self._request(c, out)
            if c.family.follow_up and why is None:
                c.turns = [{"role": "user", "content": text}]
                answering.append(c)
            else:
                settle(c, why, text)

        self._decode("ask", [(i, self._ask_job(c)) for i, c in enumerate(plan)], asked)
        following: list[_Candidate] = []

        def answered(i: int, out: list[int]) -> None:
            c = answering[i]
            ended = bool(out) and out[-1] in self.eos
            text = self.tok.decode(out[:-1] if ended else out, skip_special_tokens=False).strip()
            if not text or any(m in text for m in self.markup):
                tallies[c.family.name].dropped["empty_answer" if not text else "markup"] += 1
                return
            c.turns.append({"role": "assistant", "content": text})
            c.answer_cut = not ended
            # The follow-up is steered by its own family (the first request was by its base family's).
            c.lead, c.opening = steering(self.steer, c.family, self.rng)
            following.append(c)

        self._decode("answer", [(i, self._ids(self.tok.apply_chat_template(c.turns, tokenize=False,
                                                                           add_generation_prompt=True)))
                                for i, c in enumerate(answering)], answered)

        def followed(i: int, out: list[int]) -> None:
            c = following[i]
            settle(c, *self._request(c, out))

        self._decode("follow", [(i, self._ask_job(c)) for i, c in enumerate(following)], followed)
