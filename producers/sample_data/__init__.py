"""A small bundled chat dataset for the demo, tests and benchmarks.

`chats.jsonl` holds 400 short multi-turn chats (`messages` format, 2-3 tasks each) with
patterned, deterministic answers (arithmetic, counting, reversing, repeating, casing),
so a drafter trained on a tiny target shows its loss falling within minutes on CPU.
Regenerate it with `python -m dflash.producers.sample_data` (same seed, same bytes).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CHATS_PATH = Path(__file__).with_name("chats.jsonl")
N_CHATS = 400
SEED = 1234

_WORDS = ("red blue green apple river stone cloud light music paper tiger house "
          "silver window garden rocket honey forest winter summer").split()
_SYSTEMS = ("You are a helpful assistant.", "Answer briefly.", "You are a careful math tutor.")
_NUMBER_WORDS = "zero one two three four five six seven eight nine ten".split()


def _arith(r: random.Random) -> list[dict]:
    a, b = r.randint(0, 20), r.randint(0, 20)
    turns = [("user", f"What is {a} plus {b}?"), ("assistant", f"{a} plus {b} is {a + b}. The answer is {a + b}.")]
    if r.random() < 0.5:
        k = r.randint(2, 4)
        turns += [("user", f"And times {k}?"),
                  ("assistant", f"{a + b} times {k} is {(a + b) * k}. The answer is {(a + b) * k}.")]
    return turns


def _count(r: random.Random) -> list[dict]:
    a = r.randint(0, 15)
    b = a + r.randint(3, 8)
    return [("user", f"Count from {a} to {b}."),
            ("assistant", "Here you go: " + ", ".join(str(i) for i in range(a, b + 1)) + ".")]


def _reverse(r: random.Random) -> list[dict]:
    w = r.choice(_WORDS)
    turns = [("user", f"Spell {w} backwards."),
             ("assistant", f"{w} backwards is {w[::-1]}. Letter by letter: {' '.join(w[::-1])}.")]
    if r.random() < 0.5:
        turns += [("user", "Now in capitals."), ("assistant", f"In capitals: {w[::-1].upper()}.")]
    return turns


def _repeat(r: random.Random) -> list[dict]:
    ws = " ".join(r.sample(_WORDS, r.randint(2, 4)))
    n = r.randint(2, 3)
    return [("user", f"Repeat '{ws}' {_NUMBER_WORDS[n]} times."), ("assistant", " / ".join([ws] * n))]


def _spell_number(r: random.Random) -> list[dict]:
    n = r.randint(0, 10)
    turns = [("user", f"Write {n} as a word."),
             ("assistant", f"{n} is written {_NUMBER_WORDS[n]}. In capitals: {_NUMBER_WORDS[n].upper()}.")]
    if n < 10 and r.random() < 0.5:
        turns += [("user", "And the next one?"),
                  ("assistant", f"{n + 1} is written {_NUMBER_WORDS[n + 1]}. In capitals: {_NUMBER_WORDS[n + 1].upper()}.")]
    return turns


_TASKS = (_arith, _count, _reverse, _repeat, _spell_number)


def generate_chats(n: int = N_CHATS, seed: int = SEED) -> list[dict]:
    """`n` chats as `{"messages": [{"role", "content"}, ...]}`; deterministic in `seed`."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = []
        if r.random() < 0.3:
            msgs.append({"role": "system", "content": r.choice(_SYSTEMS)})
        # Two or three tasks per chat: multi-turn, and long enough (~100-200 tokens) that a
        # drafter with block size 16 finds anchors before the last 16 tokens.
        for _ in range(r.choice((2, 2, 3))):
            msgs += [{"role": role, "content": text} for role, text in r.choice(_TASKS)(r)]
        out.append({"messages": msgs})
    return out


def write_chats(path: Path = CHATS_PATH, n: int = N_CHATS, seed: int = SEED) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for chat in generate_chats(n, seed):
            f.write(json.dumps(chat, ensure_ascii=False) + "\n")
    return path

