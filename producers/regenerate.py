"""`--regenerate`: replace assistant turns by the target's own greedy generation; a chat
that ends in a user turn (a prompt alone) gets its answer written by the target too.

Token IDs are kept, never text: re-encoding decoded text is lossy with byte-level BPE, and the
drafter would learn tokens the target never produced. Template text around probe turns is
tokenised piece by piece, turn k generated from exactly the IDs before it. Results are cached
in SQLite (WAL: several producers on one host share it) by sample ID, for later epochs and restarts."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dflash.decoding.attention import step_kernel
from dflash.decoding.core import graphed_prefill_default, kv_bytes_per_slot
from dflash.decoding.endings import CAP, REASONS, REPETITION, EndingRule, classify
from dflash.decoding.greedy import GreedyDecoder, Job, pack_sizes
from dflash.runtime.logs import get_logger
from dflash.runtime.progress import progress

from .data import BadRow, Row
from .target import Target

log = get_logger()


FORMAT = "ids-v2"  # what a cache file holds (v2: each turn's ending); part of the key, so older caches are never read
LOOP_RULE = EndingRule()  # the default loop detector (docs/REGENERATION.md "How answers end")
DROP_DEFAULT: tuple[str, ...] = ()  # ending reasons whose rows are not trained by default (--regen-drop)
DROP_REASONS = {
    REPETITION: "answer_repetition: a regenerated answer looped and was cut (--regen-drop)",
    CAP: "answer_cap: a regenerated answer hit --max-new-tokens unfinished (--regen-drop)",
}
_PROBE = "\u2063dflash-turn-{}\u2063"  # invisible separators: never in real text


def cache_key(fingerprint: str, target: Target, tokenizer, max_new_tokens: int, template_kwargs: dict,
              loops: EndingRule | None = LOOP_RULE) -> str:
    """What makes a regeneration reusable, the loop rule included (it decides where answers stop)."""
    blob = json.dumps({
        "data": fingerprint, "target": target.info.name, "dtype": target.info.dtype,
        "config": target.config.to_json_string(use_diff=False),
        "max_new_tokens": max_new_tokens, "template": getattr(tokenizer, "chat_template", None),
        "template_kwargs": template_kwargs, "format": FORMAT, "loops": loops.describe() if loops else None,
    }, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


@dataclass
class Regenerated:
    """One regenerated conversation: the IDs to train on, the turns decoded, how each ended."""

    input_ids: list[int]
    loss_mask: list[int]
    messages: list[dict]
    endings: list[str] = field(default_factory=list)

    def row(self, r: Row) -> Row:
        return Row(r.sample, r.source, messages=self.messages, input_ids=self.input_ids, loss_mask=self.loss_mask,
                   endings=tuple(self.endings))


class RegenCache:
    """sample ID -> Regenerated, in `<dir>/<key>.sqlite`."""

    def __init__(self, directory: str | os.PathLike, key: str):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"{key}.sqlite"
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=60, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS regen_ids (sample INTEGER PRIMARY KEY, input_ids BLOB NOT NULL, "
                         "loss_mask BLOB NOT NULL, messages TEXT NOT NULL, endings TEXT NOT NULL)")

    def get(self, samples: list[int]) -> dict[int, Regenerated]:
        with self._lock:
            q = ",".join("?" * len(samples))
            rows = self._db.execute(f"SELECT sample, input_ids, loss_mask, messages, endings FROM regen_ids "
                                    f"WHERE sample IN ({q})", samples).fetchall()
        return {s: Regenerated(np.frombuffer(ids, dtype=np.int32).tolist(), list(mask), json.loads(m),
                               e.split(",") if e else []) for s, ids, mask, m, e in rows}

    def put(self, items: dict[int, Regenerated]) -> None:
        rows = [(s, np.asarray(r.input_ids, dtype=np.int32).tobytes(), bytes(r.loss_mask),
                 json.dumps(r.messages, ensure_ascii=False), ",".join(r.endings)) for s, r in items.items()]
        with self._lock:
            self._db.executemany("INSERT OR REPLACE INTO regen_ids VALUES (?, ?, ?, ?, ?)", rows)

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM regen_ids").fetchone()[0]


@dataclass
class _Conversation:

    row: Row
    probes: list[dict]  # the messages, each assistant content replaced by its probe
    turns: list[int]  # indices of the assistant messages
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    generated: list[list[int]] = field(default_factory=list)  # each turn's IDs, as generated (a loop cut)
    endings: list[str] = field(default_factory=list)
    first: bool = False  # regen_ahead.py: a lease waits for it (its turns go before look-ahead rows)
    new_tokens: int = 0

    @property
    def done(self) -> bool:
        return len(self.generated) == len(self.turns)


AUTO_ROWS_CAP = 2048  # rows past this add little: a decode step is then bound by reading the KV cache
AUTO_KV_FRACTION = 0.4  # the plan: this share of the GPU's memory holds regeneration's KV pages
FREE_CAP = 0.5  # ... at most this share of what is free (capture and a drafter keep the rest)
PAGE_SLOTS = 128  # a page: flex's K/V block on a GPU (decoding/paged.py)
CPU_PAGE_SLOTS = 16
CPU_ROWS = 16
GPU_PROMPT_ROOM = 4096  # with flex unused page-table room costs nothing, so decoders are rarely rebuilt


def kv_plan(model, device: torch.device, batch_size: int, n_jobs: int, max_prompt: int, max_new: int) -> dict:
    """A decoder's paged KV cache: pages from AUTO_KV_FRACTION of the GPU (at most FREE_CAP of
    what is free, at least one longest job) and the most rows that decode at once."""
    cap = batch_size or (AUTO_ROWS_CAP if device.type == "cuda" else CPU_ROWS)
    page = PAGE_SLOTS if device.type == "cuda" else CPU_PAGE_SLOTS
    width = -(-(max_prompt + max_new) // page)
    plan: dict = {"source": "memory" if batch_size == 0 else "--regen-batch-size", "max_prompt": max_prompt,
                  "page_size": page}
    if device.type != "cuda":
        rows = max(1, min(n_jobs, cap))
        return {**plan, "rows": rows, "pages": rows * width}
    free, total = torch.cuda.mem_get_info(device)
    per_page = kv_bytes_per_slot(model, model.dtype) * page
    want = int(total * AUTO_KV_FRACTION)
    budget = min(want, int(free * FREE_CAP))
    pages = max(width, budget // per_page - 1)  # one more is the scratch page
    return {**plan, "rows": max(1, min(n_jobs, cap, pages)), "pages": pages, "kv_fraction": AUTO_KV_FRACTION,
            "kv_plan_bytes": want, "kv_bytes": (pages + 1) * per_page, "free_bytes": free, "total_bytes": total,
            "capped_by_free": budget < want}


class Regenerator:
    """Regenerates the assistant turns of chat rows with `target` (a full model); `loops` cuts
    looping answers, `drop` names the ending reasons whose rows are skipped."""

    def __init__(self, target: Target, tokenizer, cache: RegenCache, *, max_new_tokens: int = 1024,
                 batch_size: int = 0, template_kwargs: dict | None = None, loops: EndingRule | None = LOOP_RULE,
                 drop: tuple[str, ...] = DROP_DEFAULT):
        if target.model is None:
            raise ValueError("regeneration needs the full model: load the target with full=True")
        if batch_size < 0:
            raise ValueError(f"regeneration batch size {batch_size}: 0 (sized by memory) or more")
        self.target, self.tok, self.cache = target, tokenizer, cache
        self.max_new_tokens, self.rows_asked = max_new_tokens, batch_size
        # the most rows a decoder may have (how far regen_ahead.py fills its queue)
        self.batch_size = batch_size or (AUTO_ROWS_CAP if target.device.type == "cuda" else CPU_ROWS)
        self.graphed_prefill = graphed_prefill_default(target.model, target.device)
        self.kw = dict(template_kwargs or {})
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stop_ids = stop_ids(target.model, tokenizer)
        self.generated = 0
        self.new_tokens = 0
        self.cache_hits = 0
        self.loops, self.drop = loops, tuple(drop)
        bad = [r for r in self.drop if r not in DROP_REASONS]
        if bad:
            raise ValueError(f"drop {bad}: only {', '.join(DROP_REASONS)} can be dropped")
        self.endings = dict.fromkeys(REASONS, 0)  # answers generated here, by how they ended

    def end_turn(self, c: _Conversation, out: list[int]) -> list[int]:
        """Record how `c`'s turn `out` ended; returns the IDs to keep (a loop cut as the rule's `keep` says)."""
        reason, keep = classify(out, self.stop_ids, self.loops)
        c.endings.append(reason)
        self.endings[reason] += 1
        return out[:keep]

    def drop_reason(self, row: Row) -> str | None:
        """Why the producer must skip `row` (a regenerated turn ended in a dropped way), or None."""
        for reason in (REPETITION, CAP):
            if reason in self.drop and reason in (row.endings or ()):
                return DROP_REASONS[reason]
        return None

    def apply(self, rows: list[Row]) -> list[Row]:
        """`rows` with regenerated assistant turns as exact IDs (cached or new); text rows unchanged.
        Raises BadRow when the chat template cannot render a row's turns verbatim."""
        chats = [r for r in rows if r.messages is not None]
        if not chats:
            return rows
        done = self.cache.get([r.sample for r in chats])
        todo = [r for r in chats if r.sample not in done]
        self.cache_hits += len(chats) - len(todo)
        t0 = time.monotonic()
        new_tokens = 0
        if todo:
            convs, new_tokens = self._regenerate(todo)
            self.cache.put(dict(zip((r.sample for r in todo), convs)))
            done.update(zip((r.sample for r in todo), convs))
        self.generated += len(todo)
        self.new_tokens += new_tokens
        log.info("produce.regen", rows=len(chats), cached=len(chats) - len(todo), generated=len(todo),
                 new_tokens=new_tokens, gen_s=round(time.monotonic() - t0, 3), endings=count_endings(
                     done[r.sample] for r in chats))
        return [done[r.sample].row(r) if r.messages is not None else r for r in rows]

    def check(self, row: Row) -> None:
        """Raise BadRow before any generation if the template cannot render `row` around probes."""
        if row.messages is not None:
            c = self._start(row)
            for k in range(len(c.turns) + 1):
                self._render(c, k)

    def _regenerate(self, rows: list[Row]) -> tuple[list[Regenerated], int]:
        """Every turn of every row, continuously batched; (conversations, tokens generated)."""
        convs = [self._start(r) for r in rows]
        jobs: deque[Job] = deque()
        for i, c in enumerate(convs):
            if c.done:
                continue
            self._append(c, self._render(c, 0), loss=0)  # the template text up to turn 0
            jobs.append(Job(i, list(c.ids)))
        total = 0
        bar = progress("regenerate", total=len(jobs), unit="chat")

        def turn_done(job: Job, out: list[int]) -> None:
            nonlocal total
            c = convs[job.key]
            total += len(out)  # generated, a loop's cut tail included (decode time spent)
            out = self.end_turn(c, out)
            c.generated.append(out)
            c.ids += out
            c.mask += [1] * len(out)
            if not c.done:  # its next turn waits for a free row like any other
                self._append(c, self._render(c, len(c.generated)), loss=0)
                jobs.append(Job(job.key, list(c.ids)))
            else:
                bar.update()
                bar.note(new_tokens=total)

        with bar:
            while jobs:
                # a later turn that outgrew this decoder goes to the next round's
                dec = self._decoder(len(jobs), self.prompt_slots(jobs, lambda j: convs[j.key]))
                leftover = self._run(dec, jobs, turn_done)
                jobs = deque(leftover)
        return [self._finish(c) for c in convs], total

    def prompt_slots(self, jobs, conv_of) -> int:
        """Prompt room: the longest prompt rounded up to 64, plus an answer only where a later turn
        follows (with sdpa every step attends each row's whole room)."""
        longest = max(len(j.prompt) for j in jobs)
        more = any(len(conv_of(j).generated) + 1 < len(conv_of(j).turns) for j in jobs)
        return -(-(longest + (self.max_new_tokens if more else 0)) // 64) * 64

    def _decoder(self, n_jobs: int, max_prompt: int) -> GreedyDecoder:
        """A decoder on a paged cache from `kv_plan`; with flex at least GPU_PROMPT_ROOM of room,
        rebuilt with `max_prompt` if flex fails (sdpa gathers each row's whole room)."""
        model, device = self.target.model, self.target.device
        room = max_prompt
        if device.type == "cuda" and step_kernel(model, device) == "flex":
            room = max(room, GPU_PROMPT_ROOM)
        while True:
            plan = kv_plan(model, device, self.rows_asked, n_jobs, room, self.max_new_tokens)
            log.info("produce.regen_rows", jobs=n_jobs, graphed_prefill=self.graphed_prefill, **plan)
            with self.target.lock:  # building it runs the model under another attention (see _run)
                dec = GreedyDecoder(model, rows=plan["rows"], max_prompt=room, max_new_tokens=self.max_new_tokens,
                                    stop_ids=self.stop_ids,
                                    prefill_sizes=pack_sizes(4096) if self.graphed_prefill else None,
                                    kv_block=plan["page_size"], pages=plan["pages"], ending=self.loops)
            if dec.core.kernel == "flex" or room == max_prompt:
                return dec
            del dec
            room = max_prompt

    def _run(self, dec: GreedyDecoder, jobs: deque, on_done) -> list[Job]:
        # the core's own attention, not capture's: transformers' flex failed to compile under generation
        with self.target.lock:
            return dec.run(jobs, on_done)

    def _start(self, row: Row) -> _Conversation:
        messages = row.messages
        if messages[-1]["role"] == "user":  # a prompt waiting for its answer: the target writes it
            row = Row(row.sample, row.source, messages=[*messages, {"role": "assistant", "content": ""}])
        turns = [i for i, m in enumerate(row.messages) if m["role"] == "assistant"]
        probes = [{**m, "content": _PROBE.format(k)} if m["role"] == "assistant" else dict(m)
                  for k, m in enumerate(row.messages)]
        return _Conversation(row, probes, turns)

    def _render(self, c: _Conversation, k: int) -> str:
        """Template text between turn k-1's content and turn k's. Raises BadRow."""
        msgs = c.probes[: c.turns[k]] if k < len(c.turns) else c.probes
        try:
            text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=k < len(c.turns),
                                                **self.kw)
        except Exception as e:  # jinja raises TemplateError for e.g. non-alternating roles
            raise BadRow(c.row.sample, c.row.source, f"chat template failed: {type(e).__name__}: {e}") from None
        if k == 0:
            return text
        probe = _PROBE.format(c.turns[k - 1])
        if text.count(probe) != 1:
            raise BadRow(c.row.sample, c.row.source, f"the chat template does not render assistant turn {k - 1} "
                         "(0-based) verbatim; cannot place the regenerated tokens")
        text = text.split(probe, 1)[1]
        # The template ends the turn with its marker (<|im_end|>); the target may have emitted it already.
        last = c.generated[k - 1] if k - 1 < len(c.generated) else []  # none yet: check()
        if last and last[-1] in self.stop_ids:
            end = self.tok.decode([last[-1]])
            if end and text.startswith(end):
                text = text[len(end):]
        return text

    def _append(self, c: _Conversation, text: str, loss: int) -> None:
        ids = self.tok(text, add_special_tokens=False)["input_ids"] if text else []
        c.ids += ids
        c.mask += [loss] * len(ids)

    def _finish(self, c: _Conversation) -> Regenerated:
        self._append(c, self._render(c, len(c.turns)), loss=0)
        messages = [dict(m) for m in c.row.messages]
        for i, out in zip(c.turns, c.generated):
            messages[i]["content"] = self.tok.decode(out, skip_special_tokens=True).strip()
        return Regenerated(c.ids, c.mask, messages, list(c.endings))


def count_endings(regs) -> dict[str, int]:
    out = dict.fromkeys(REASONS, 0)
    for r in regs:
        for e in r.endings:
            out[e] += 1
    return out

def stop_ids(model, tokenizer) -> set[int]:
    """Where a turn ends: the generation config's eos IDs (e.g. <|im_end|>), else the tokenizer's EOS."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}
