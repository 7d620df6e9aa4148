"""`--regenerate`: replace assistant turns by the target's own greedy generation.

DFlash drafters learn what the target says, so the paper trains on responses regenerated
by the target. Turns are generated in order (turn k+1's prompt holds regenerated turn k),
batched across the rows of a lease with left padding. Results are cached in one SQLite
file per (dataset fingerprint, target, generation settings), keyed by sample ID, so an
epoch 2 or a restarted producer reads them instead of generating again. SQLite (WAL, busy
timeout) because several producers on one host share the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from pathlib import Path

import torch

from dflash.protocol.logs import get_logger

from .data import Row
from .target import Target

log = get_logger()


def cache_key(fingerprint: str, target: Target, tokenizer, max_new_tokens: int, template_kwargs: dict) -> str:
    """What makes a regeneration reusable: data, weights' identity, dtype, settings, template."""
    blob = json.dumps({
        "data": fingerprint, "target": target.info.name, "dtype": target.info.dtype,
        "config": target.config.to_json_string(use_diff=False),
        "max_new_tokens": max_new_tokens, "template": getattr(tokenizer, "chat_template", None),
        "template_kwargs": template_kwargs,
    }, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


class RegenCache:
    """sample ID -> regenerated messages, in `<dir>/<key>.sqlite`."""

    def __init__(self, directory: str | os.PathLike, key: str):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"{key}.sqlite"
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=60, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS regen (sample INTEGER PRIMARY KEY, messages TEXT NOT NULL)")

    def get(self, samples: list[int]) -> dict[int, list[dict]]:
        with self._lock:
            q = ",".join("?" * len(samples))
            rows = self._db.execute(f"SELECT sample, messages FROM regen WHERE sample IN ({q})", samples)
            return {s: json.loads(m) for s, m in rows}

    def put(self, items: dict[int, list[dict]]) -> None:
        with self._lock:
            self._db.executemany("INSERT OR REPLACE INTO regen VALUES (?, ?)",
                                 [(s, json.dumps(m, ensure_ascii=False)) for s, m in items.items()])

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM regen").fetchone()[0]


class Regenerator:
    """Regenerates the assistant turns of chat rows with `target` (a full model)."""

    def __init__(self, target: Target, tokenizer, cache: RegenCache, *, max_new_tokens: int = 1024,
                 batch_size: int = 16, template_kwargs: dict | None = None):
        if target.model is None:
            raise ValueError("regeneration needs the full model: load the target with full=True")
        self.target, self.tok, self.cache = target, tokenizer, cache
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
        self.kw = dict(template_kwargs or {})
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.generated = 0
        self.cache_hits = 0

    def apply(self, rows: list[Row]) -> list[Row]:
        """`rows` with regenerated assistant turns (cached or new); text rows unchanged."""
        chats = [r for r in rows if r.messages is not None]
        if not chats:
            return rows
        done = self.cache.get([r.sample for r in chats])
        todo = [r for r in chats if r.sample not in done]
        self.cache_hits += len(chats) - len(todo)
        t0 = time.monotonic()
        new_tokens = 0
        for i in range(0, len(todo), self.batch_size):
            part = todo[i:i + self.batch_size]
            convs, n = self._regenerate(part)
            new_tokens += n
            self.cache.put(dict(zip((r.sample for r in part), convs)))
            done.update(zip((r.sample for r in part), convs))
        self.generated += len(todo)
        log.info("produce.regen", rows=len(chats), cached=len(chats) - len(todo), generated=len(todo),
                 new_tokens=new_tokens, gen_s=round(time.monotonic() - t0, 3))
        return [Row(r.sample, r.source, messages=done[r.sample]) if r.messages is not None else r for r in rows]

    def _regenerate(self, rows: list[Row]) -> tuple[list[list[dict]], int]:
        """Turn by turn for all `rows` at once. Returns the new conversations, tokens generated."""
        src = [r.messages for r in rows]
        convs: list[list[dict]] = [[] for _ in rows]
        pos = [0] * len(rows)
        total = 0
        while True:
            # Copy every non-assistant message up to the next assistant turn.
            for k, msgs in enumerate(src):
                while pos[k] < len(msgs) and msgs[pos[k]]["role"] != "assistant":
                    convs[k].append(dict(msgs[pos[k]]))
                    pos[k] += 1
            want = [k for k, msgs in enumerate(src) if pos[k] < len(msgs)]
            if not want:
                return convs, total
            texts, n = self._generate([convs[k] for k in want])
            total += n
            for k, text in zip(want, texts):
                convs[k].append({"role": "assistant", "content": text})
                pos[k] += 1

    def _generate(self, prompts: list[list[dict]]) -> tuple[list[str], int]:
        texts = [self.tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True, **self.kw)
                 for p in prompts]
        enc = [self.tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        width = max(len(e) for e in enc)
        # Left padding: every row's last prompt token sits at the same column for generate().
        ids = torch.tensor([[self.pad_id] * (width - len(e)) + e for e in enc], device=self.target.device)
        att = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc], device=self.target.device)
        with self.target.lock, torch.inference_mode():
            out = self.target.model.generate(
                input_ids=ids, attention_mask=att, max_new_tokens=self.max_new_tokens, do_sample=False,
                pad_token_id=self.pad_id, temperature=None, top_p=None, top_k=None,
            )
        new = out[:, width:]
        n_tokens = int((new != self.pad_id).sum())
        return [self.tok.decode(row, skip_special_tokens=True).strip() for row in new], n_tokens
