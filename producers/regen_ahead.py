"""`--regenerate` ahead of the leases: one regeneration thread keeps the decoder full while
the producer captures and ships the rows already made.

Leased rows go first, then the run's sample order up to `ahead` rows past the furthest leased;
each conversation is cached when finished (a crash loses only rows in flight), and producers of
a host share work by claims in the cache file. The thread holds the target's lock at most
`slice_s` at a time and yields to a waiting capture: feeding the drafters comes first."""

from __future__ import annotations

import copy
import os
import socket
import sqlite3
import threading
import time
from collections import deque
from typing import Iterable

import torch

from dflash.decoding.greedy import GreedyDecoder, Job
from dflash.runtime.logs import get_logger
from dflash.runtime.threads import name_this_thread

from .data import BadRow, DataSource, Row
from .regenerate import RegenCache, Regenerated, Regenerator, _Conversation

log = get_logger()

PROGRESS_S = 30.0  # a produce.regen_progress line at most this often


class Claims:
    """Which producer of the host regenerates which row: a table beside the cache's."""

    def __init__(self, cache: RegenCache, owner: str | None = None):
        self.host = socket.gethostname()
        self.owner = owner or f"{self.host}:{os.getpid()}"
        self._db = sqlite3.connect(cache.path, timeout=60, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS regen_claims (sample INTEGER PRIMARY KEY, owner TEXT NOT NULL)")
        self._lock = threading.Lock()
        self._alive: dict[str, bool] = {}

    def claim(self, samples: list[int]) -> tuple[list[int], dict[int, str]]:
        """Claim `samples`: (ours, {sample: live other owner}); a dead owner's claim is taken over."""
        if not samples:
            return [], {}
        with self._lock:
            q = ",".join("?" * len(samples))
            held = dict(self._db.execute(f"SELECT sample, owner FROM regen_claims WHERE sample IN ({q})",
                                         samples).fetchall())
            others = {s: o for s, o in held.items() if o != self.owner and self._live(o)}
            ours = [s for s in samples if s not in others]
            self._db.executemany("INSERT OR REPLACE INTO regen_claims VALUES (?, ?)", [(s, self.owner) for s in ours])
        return ours, others

    def release(self, samples: Iterable[int]) -> None:
        with self._lock:
            self._db.executemany("DELETE FROM regen_claims WHERE sample = ? AND owner = ?",
                                 [(s, self.owner) for s in samples])

    def alive(self, owner: str) -> bool:
        with self._lock:
            self._alive.pop(owner, None)
            return self._live(owner)

    def _live(self, owner: str) -> bool:
        if owner not in self._alive:
            host, _, pid = owner.rpartition(":")
            if host != self.host or not pid.isdigit():
                self._alive[owner] = True  # another host's file system: its claims are its own business
            else:
                try:
                    os.kill(int(pid), 0)
                    self._alive[owner] = True
                except ProcessLookupError:
                    self._alive[owner] = False
                except PermissionError:  # another user's live process
                    self._alive[owner] = True
        return self._alive[owner]


class RegenAhead:
    """The regeneration thread (module docstring)."""

    def __init__(self, regen: Regenerator, dataset: DataSource, *, ahead: int, order: list[int] | None = None,
                 slice_s: float = 0.25, owner: str | None = None):
        # its own tokenizer: a fast tokenizer used from two threads can fail ("Already borrowed")
        regen.tok = copy.deepcopy(regen.tok)
        self.regen, self.dataset, self.cache = regen, dataset, regen.cache
        self.ahead, self.slice_s = max(0, ahead), slice_s
        self.claims = Claims(self.cache, owner)
        self._order = list(order or [])
        self._pos = {s: i for i, s in enumerate(self._order)}
        self._cursor = 0  # next order index the look-ahead considers
        self._horizon = self.ahead  # order indices below this may be made ahead: from the start on
        self._cond = threading.Condition()
        self._wanted: deque[Row] = deque()  # leased rows to start, first come first
        self._want: set[int] = set()  # leased samples not yet handed out
        self._ready: dict[int, Regenerated] = {}  # finished rows a lease waits for
        self._running: dict[int, _Conversation] = {}  # started here, not finished
        self._foreign: dict[int, tuple[Row, str]] = {}  # leased rows another producer is making
        self._made: dict[int, int] = {}  # sample -> new tokens, made here and not handed out yet
        self._jobs: deque[Job] = deque()
        self._dec: GreedyDecoder | None = None  # the decoder now running (its figures for the progress line)
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.rows_done = self.new_tokens = self.ahead_rows = 0
        self._thread = threading.Thread(target=self._loop, name="dflash-regen", daemon=True)
        self._t0 = self._last_progress = time.monotonic()

    # ------------------------------------------------------------ the prefetch thread's side

    def start(self) -> None:
        log.info("produce.regen_ahead", owner=self.claims.owner, ahead=self.ahead, order_rows=len(self._order),
                 rows_cached=len(self.cache), slice_s=self.slice_s)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)

    def request(self, rows: list[Row]) -> dict[int, Regenerated]:
        """A lease's chat rows: those cached now; the others are made (or waited for) first."""
        samples = [r.sample for r in rows]
        with self._cond:
            have = self.cache.get(samples) if samples else {}
            for r in rows:
                self._horizon = max(self._horizon, self._pos.get(r.sample, -1) + 1 + self.ahead)
                if r.sample in have:
                    continue
                self._want.add(r.sample)
                if r.sample not in self._running and r.sample not in self._ready:
                    self._wanted.append(r)
            self._cond.notify_all()
        return have

    def wait(self, samples: set[int], timeout_s: float = 1.0) -> dict[int, Regenerated]:
        """Ready rows of `samples`, each handed out once; raises the thread's error if it died."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._stop.is_set():
                    raise RuntimeError("the regeneration thread was stopped")
                if self.error is not None:
                    raise RuntimeError(f"the regeneration thread failed: {type(self.error).__name__}: "
                                       f"{self.error}") from self.error
                got = {s: self._ready.pop(s) for s in samples if s in self._ready}
                left = deadline - time.monotonic()
                if got or left <= 0:
                    self._want.difference_update(got)
                    return got
                self._cond.wait(left)

    def made_here(self, samples: Iterable[int]) -> tuple[int, int]:
        """(rows, new tokens) of `samples` this process regenerated, counted once each."""
        with self._cond:
            n = [self._made.pop(s) for s in samples if s in self._made]
        return len(n), sum(n)

    # ------------------------------------------------------------ the regeneration thread

    def _loop(self) -> None:
        name_this_thread("dflash-regen")
        try:
            dec: GreedyDecoder | None = None
            while not self._stop.is_set():
                self._intake()
                if not self._jobs:
                    with self._cond:
                        if not self._wanted and not self._stop.is_set():
                            self._cond.wait(0.5 if self._foreign else 5.0)
                    continue
                need = max(len(j.prompt) for j in self._jobs)
                if dec is None or need > dec.max_prompt:
                    dec = None  # its cache goes before the next is allocated
                    dec = self.regen._decoder(self.regen.batch_size, self.regen.prompt_slots(self._jobs, lambda j: j.key))
                self._drive(dec)
        except BaseException as e:  # handed to the prefetch thread, which raises it
            log.error("produce.regen_failed", error=f"{type(e).__name__}: {str(e)[:500]}")
            with self._cond:
                self.error = e
                self._cond.notify_all()

    def _drive(self, dec: GreedyDecoder) -> None:
        """Decode until empty, `slice_s` at a time under the target's lock."""
        self._dec = dec
        leftover: list[Job] = []
        rounds = dec.rounds(self._jobs, self._turn_done, leftover)
        while not self._stop.is_set():
            t0 = time.monotonic()
            with self.regen.target.lock, dec.core.attending(), torch.inference_mode():
                try:
                    while time.monotonic() - t0 < self.slice_s and not self.regen.target.capture_waiting:
                        next(rounds)
                        if not leftover:  # a too-long prompt: drain, then size a decoder for it
                            self._intake()
                except StopIteration:
                    break
            time.sleep(0.001)  # the capture waiting on the lock gets it now
            self._progress()
        self._jobs.extendleft(reversed(leftover))

    def _intake(self) -> None:
        """Leased rows first, then the look-ahead's, into the decoder's queue."""
        with self._cond:
            wanted = list(self._wanted)
            self._wanted.clear()
        if wanted:
            self._start_rows(wanted, first=True)
        self._poll_foreign()
        room = 2 * self.regen.batch_size - len(self._running)
        if room > 0 and len(self._jobs) < self.regen.batch_size:
            self._start_rows(self._next_ahead(room), first=False)

    def _next_ahead(self, room: int) -> list[Row]:
        """Up to `room` rows of the order within the horizon: not cached, not claimed."""
        out: list[Row] = []
        while len(out) < room and self._cursor < min(self._horizon, len(self._order)):
            chunk = self._order[self._cursor:min(self._horizon, len(self._order), self._cursor + room - len(out))]
            self._cursor += len(chunk)
            with self._cond:
                cached = self.cache.get(chunk)
                # `ahead` bounds decoding, not rows passed over: each cached row extends the reach
                self._horizon += len(cached)
                chunk = [s for s in chunk if s not in cached and s not in self._running and s not in self._want]
            for s in chunk:
                try:
                    row = self.dataset.read(s)
                    if row.messages is None:
                        continue
                    self.regen.check(row)
                except BadRow:  # its lease reports it (prepare checks every row again)
                    continue
                out.append(row)
        return out

    def _start_rows(self, rows: list[Row], first: bool) -> None:
        with self._cond:  # a row the look-ahead started already: its next turns go first now
            rows = [r for r in rows if not self._mark_running(r.sample, first)]
        ours, others = self.claims.claim([r.sample for r in rows])
        mine = set(ours)
        jobs: list[Job] = []
        for r in rows:
            if r.sample not in mine:
                if first:
                    with self._cond:
                        self._foreign[r.sample] = (r, others[r.sample])
                continue
            c = self.regen._start(r)
            c.first = first
            with self._cond:
                self._running[r.sample] = c
            self.ahead_rows += not first
            if c.done:  # no assistant turn to make
                self._finished(c)
                continue
            self.regen._append(c, self.regen._render(c, 0), loss=0)
            jobs.append(Job(c, list(c.ids)))
        if first:
            self._jobs.extendleft(reversed(jobs))
        else:
            self._jobs.extend(jobs)

    def _mark_running(self, sample: int, first: bool) -> bool:
        c = self._running.get(sample)
        if c is not None and first:
            c.first = True
        return c is not None

    def _turn_done(self, job: Job, out: list[int]) -> None:
        c = job.key
        c.new_tokens += len(out)  # generated, a loop's cut tail included (decode time spent)
        out = self.regen.end_turn(c, out)
        c.generated.append(out)
        c.ids += out
        c.mask += [1] * len(out)
        if c.done:
            self._finished(c)
            return
        self.regen._append(c, self.regen._render(c, len(c.generated)), loss=0)
        nxt = Job(c, list(c.ids))
        if c.first:
            self._jobs.appendleft(nxt)
        else:
            self._jobs.append(nxt)

    def _finished(self, c: _Conversation) -> None:
        new_tokens = c.new_tokens
        reg = self.regen._finish(c)
        s = c.row.sample
        with self._cond:
            self.cache.put({s: reg})
            self._running.pop(s, None)
            self._made[s] = new_tokens
            if s in self._want:
                self._ready[s] = reg
            self._cond.notify_all()
        self.claims.release([s])
        self.regen.generated += 1
        self.rows_done += 1
        self.new_tokens += new_tokens

    def _poll_foreign(self) -> None:
        """Leased rows another producer makes: read once cached, made here if their owner died."""
        if not self._foreign:
            return
        with self._cond:
            have = self.cache.get(list(self._foreign))
            for s, reg in have.items():
                del self._foreign[s]
                if s in self._want:
                    self._ready[s] = reg
            dead = [r for s, (r, owner) in self._foreign.items() if not self.claims.alive(owner)]
            for r in dead:
                del self._foreign[r.sample]
            if have:
                self._cond.notify_all()
        if dead:
            self._start_rows(dead, first=True)

    def _progress(self) -> None:
        now = time.monotonic()
        if now - self._last_progress < PROGRESS_S:
            return
        self._last_progress = now
        with self._cond:
            waiting = len(self._want) - len(self._ready)
        dec, book = self._dec, self._dec.book if self._dec is not None else None
        log.info("produce.regen_progress", rows=self.rows_done, ahead_rows=self.ahead_rows,
                 new_tokens=self.new_tokens, tokens_per_s=round(self.new_tokens / max(1e-9, now - self._t0), 1),
                 running=len(self._running), waiting=waiting, foreign=len(self._foreign),
                 horizon=min(self._horizon, len(self._order)), cursor=self._cursor,
                 live_rows=dec.live if dec else 0, decoder_rows=dec.rows if dec else 0,
                 pages_total=book.total if book else 0, pages_used=book.used if book else 0,
                 pages_peak=book.peak if book else 0,
                 preempted=dec.preempted if dec else 0, endings=dict(self.regen.endings))
