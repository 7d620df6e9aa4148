"""Helpers for the producer tests: data files and chats."""

from __future__ import annotations

import json


def write_jsonl(path, rows, raw_lines=()) -> str:
    """Rows as JSON lines, then raw lines appended verbatim (for malformed ones)."""
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return str(path)


def chat(i: int, turns: int = 2) -> dict:
    msgs = []
    for t in range(turns):
        msgs += [{"role": "user", "content": f"Question {i}.{t}: what is {i} plus {t}?"},
                 {"role": "assistant", "content": f"{i} plus {t} is {i + t}."}]
    return {"messages": msgs}
