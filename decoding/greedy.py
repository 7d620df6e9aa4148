"""Batched greedy decoding on the core (decoding/core.py): continuous batching over a
decoder's rows, prefills packed (and graphed on a GPU, `PackedPrefill`), a Gumbel-max
`Sampler` for sampled generation, and `greedy_generate` for a plain list of prompts."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch
from torch import nn

from .core import Core
from .endings import EndingRule, looping_rows
from .paged import Pages


def pack_sizes(limit: int) -> list[int]:
    """Pack sizes up to `limit`: 64..512, then steps of 512 (padding wastes at most half a small pack)."""
    sizes = [x for x in (64, 128, 256, 512) if x < limit] + list(range(512, limit, 512)) + [limit]
    return sorted(set(sizes))


class PackedPrefill:
    """Refilled rows' prompts packed into one forward padded to a fixed size, replayed from a CUDA
    graph from a size's second use on (each eager forward pays transformers' per-layer Python).
    Pads write the cache's last slot, which no live row attends."""

    def __init__(self, core: Core, rows: int, sizes: Iterable[int], pick: Callable[[torch.Tensor], torch.Tensor]):
        self.core, self.rows, self.pick = core, rows, pick
        self.sizes = sorted(set(sizes))
        self._used: set[int] = set()
        self._static: dict[int, tuple[torch.Tensor, torch.Tensor, Callable[[], None]]] = {}
        self._first = torch.zeros(rows, dtype=torch.long, device=core.device)  # every graph's output
        self.replays = 0  # forwards run from a graph, or from its fallback

    @property
    def limit(self) -> int:
        return self.sizes[-1]

    def __call__(self, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        lens = [len(p) for p in prompts]
        T, R = sum(lens), len(prompts)
        if T > self.limit or R > self.rows:
            raise ValueError(f"a pack of {T} tokens in {R} rows exceeds {self.limit} tokens or {self.rows} rows")
        size = next(x for x in self.sizes if x >= T)
        seg = np.repeat(np.arange(R), lens)
        pos = np.arange(T) - np.repeat(np.cumsum(lens) - lens, lens)
        host = np.zeros((5, size), dtype=np.int64)  # ids, segment, position, cache row, cache slot
        host[0, :T] = [t for p in prompts for t in p]
        host[1, :T], host[1, T:] = seg, R  # pads: a segment of their own
        host[2, :T] = pos
        host[3, :T] = np.asarray(rows)[seg]
        host[4, :T], host[4, T:] = pos, self.core.slots - 1
        last = np.zeros(self.rows, dtype=np.int64)
        last[:R] = np.cumsum(lens) - 1
        if size not in self._static:
            packed = torch.from_numpy(host).to(self.core.device)
            where = torch.from_numpy(last).to(self.core.device)
            if size not in self._used:  # a size used once (one eval prompt) is not worth a capture
                self._used.add(size)
                return self.pick(self.core.packed(*packed, where))[:R]
            # the capture's warm-up runs it twice on these inputs: the same writes each time
            replay = self.core.graphed(lambda: self._first.copy_(self.pick(self.core.packed(*packed, where))))
            self._static[size] = (packed, where, replay)
        else:
            packed, where, replay = self._static[size]
            packed.copy_(torch.from_numpy(host))
            where.copy_(torch.from_numpy(last))
        replay()
        self.replays += 1
        return self._first[:R].clone()


@dataclass
class Job:
    key: object
    prompt: list[int]
    max_new: int | None = None  # fewer new tokens than the decoder's max_new_tokens, if set


class GreedyDecoder:
    """Greedy decoding with continuous batching over `rows` slots, as `generate(do_sample=False)`
    gives; one decode step is a CUDA graph and the host syncs only every `sync_every` steps.
    `pages` > 0: a paged cache, rows get pages as they grow and the newest give theirs back
    when they run out (greedy: restarting gives the same answer)."""

    def __init__(self, model: nn.Module, *, rows: int, max_prompt: int, max_new_tokens: int, stop_ids: Iterable[int],
                 graphs: bool | None = None, sync_every: int = 8, refill_min: int | None = None,
                 prefill_tokens: int = 2048, prefill_sizes: Iterable[int] | None = None,
                 pick: Callable[[torch.Tensor], torch.Tensor] | None = None, kernel: str = "auto",
                 kv_block: int = 128, pages: int = 0, ending: EndingRule | None = None):
        if rows < 1 or max_new_tokens < 1:
            raise ValueError(f"rows {rows} and max_new_tokens {max_new_tokens} must be >= 1")
        self.max_prompt, self.max_new = max_prompt, max_new_tokens
        # one slot past any live row's reach: PackedPrefill's pads write there
        self.core = Core(model, rows, max_prompt + max_new_tokens + (0 if pages else 1), graphs=graphs, kernel=kernel,
                         kv_block=kv_block, pages=pages)
        self.book = Pages(self.core.cache) if pages else None
        if self.book is not None and pages < self.core.cache.width:
            raise ValueError(f"{pages} KV pages of {kv_block} slots do not hold one job of {max_prompt} prompt "
                             f"+ {max_new_tokens} new tokens ({self.core.cache.width} pages)")
        self._need: dict[int, int] = {}  # paged: row -> slots its job fills at most
        self._at: dict[int, int] = {}  # paged: row -> its next slot, as the host counts
        self._seq: dict[int, int] = {}  # paged: row -> when its job started (the newest gives pages back)
        self._started = 0
        self.preempted = 0  # paged: jobs that gave their pages back and start again
        self.live = 0  # rows decoding in the last round
        self.rows, self.sync_every = rows, max(1, sync_every)
        self.refill_min = max(1, rows // 16) if refill_min is None else max(1, refill_min)
        dev = self.core.device
        stops = sorted(set(stop_ids))
        self.stops = torch.tensor(stops or [-1], device=dev)
        self.tok = torch.zeros(rows, dtype=torch.long, device=dev)  # each row's last token
        self.start = torch.zeros(rows, dtype=torch.long, device=dev)  # slot its next token goes to
        self.off = torch.zeros(rows, dtype=torch.long, device=dev)
        self.n = torch.zeros(rows, dtype=torch.long, device=dev)  # tokens generated
        self.done = torch.ones(rows, dtype=torch.bool, device=dev)
        self.limit = torch.full((rows,), max_new_tokens, dtype=torch.long, device=dev)  # per row
        self.out = torch.zeros(rows, max_new_tokens, dtype=torch.long, device=dev)
        self._ar = torch.arange(rows, device=dev)
        self.steps = 0
        self.prefills = 0
        self.packed_prefills = 0
        self.pick = pick or _argmax
        self.ending = ending
        # graphed packs off by default until a GPU measurement says they are faster (docs/REGENERATION.md)
        self.prefill = PackedPrefill(self.core, rows, prefill_sizes, self.pick) if prefill_sizes else None
        self.prefill_tokens = max(1, prefill_tokens)
        with self.core.attending(), torch.inference_mode():
            self.core.allocate()
            self._step = self.core.graphed(self._decode_step)  # all rows done: warm-up changes nothing real

    @torch.inference_mode()
    def _decode_step(self) -> None:
        logits, _ = self.core.step(self.tok[:, None], self.start, self.off, last_only=True)
        nxt = self.pick(logits[:, -1])
        live = ~self.done
        col = self.n.clamp_max(self.max_new - 1)
        self.out[self._ar, col] = torch.where(live, nxt, self.out[self._ar, col])
        self.n += live
        self.start += live
        self.tok.copy_(torch.where(live, nxt, self.tok))
        self.done |= live & (torch.isin(nxt, self.stops) | (self.n >= self.limit))

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        """Greedy continuations of `prompts`, in order."""
        res: list[list[int] | None] = [None] * len(prompts)

        def keep(job: Job, tokens: list[int]) -> None:
            res[job.key] = tokens

        left = self.run(deque(Job(i, p) for i, p in enumerate(prompts)), keep)
        if left:
            raise ValueError(f"{len(left)} prompt(s) exceed the decoder's max_prompt {self.max_prompt}")
        return res  # type: ignore[return-value]

    @torch.inference_mode()
    def run(self, jobs: deque, on_done: Callable[[Job, list[int]], None]) -> list[Job]:
        """Decode `jobs` (`on_done` may append more), handing each result to `on_done`; returns the
        jobs longer than `max_prompt`, undecoded."""
        leftover: list[Job] = []
        with self.core.attending():
            for _ in self.rounds(jobs, on_done, leftover):
                pass
        return leftover

    def rounds(self, jobs: deque, on_done: Callable[[Job, list[int]], None], leftover: list[Job]):
        """`run` one round (refill, `sync_every` steps) per `next()`, each inside `core.attending()` and
        inference mode; between rounds other threads may append jobs (deque appends are atomic)."""
        busy: dict[int, Job] = {}
        free = list(range(self.rows))
        while jobs or busy:
            if self.book is not None and busy:
                self._grow(busy, free, jobs)
            if jobs and free and (len(free) >= self.refill_min or not busy or len(jobs) <= len(free)):
                take = []
                pages = 0  # paged: pages the jobs taken so far start with
                while jobs and len(take) < len(free):
                    j = jobs.popleft()
                    if not j.prompt:
                        raise ValueError(f"job {j.key!r}: empty prompt")
                    if len(j.prompt) > self.max_prompt:
                        leftover.append(j)
                        continue
                    if self.book is not None:
                        need = self._admit(j, len(busy) + len(take), pages)
                        if need is None:
                            jobs.appendleft(j)
                            break
                        pages += need
                    take.append(j)
                take = [(free.pop(0), j) for j in take]
                if take:
                    if self.book is not None:
                        self._start_rows(take)
                    self._fill(take)
                    busy.update(take)
            if not busy:
                continue
            self.live = len(busy)
            for _ in range(self.sync_every):
                self._step()
            self.steps += self.sync_every
            if self.ending is not None:  # on the device, before the sync: looping rows finish now
                self.done |= looping_rows(self.out, self.n, self.ending)
            done = self.done.tolist()  # the one synchronisation per `sync_every` steps
            finished = [r for r in busy if done[r]]
            if finished:
                idx = torch.tensor(finished, device=self.core.device)
                lens = self.n[idx].tolist()
                outs = self.out[idx].tolist()
                if self.book is not None:
                    self.book.release(finished)
                for r, n, o in zip(finished, lens, outs):
                    job = busy.pop(r)
                    free.append(r)
                    on_done(job, o[:n])
            for r in busy if self.book is not None else ():
                self._at[r] += self.sync_every
            yield len(busy)

    # ------------------------------------------------------------ paged rows

    def _limit(self, job: Job) -> int:
        return min(job.max_new or self.max_new, self.max_new)

    def _admit(self, job: Job, live: int, pending: int) -> int | None:
        """Pages `job` starts with, or None when the free pages (less a round's growth of the live rows) lack them."""
        p = len(job.prompt)
        need = self.book.pages_for(min(p + self.sync_every, p + self._limit(job) - 1))
        room = -(-live * self.sync_every // self.core.cache.page) if live else 0
        return need if pending + need + room <= len(self.book.free) else None

    def _start_rows(self, take: list[tuple[int, Job]]) -> None:
        for r, j in take:
            p = len(j.prompt)
            self._need[r] = p + self._limit(j) - 1
            self._at[r] = p
            self._seq[r] = self._started
            self._started += 1
        self.book.grow({r: min(self._at[r] + self.sync_every, self._need[r]) for r, _ in take})

    def _grow(self, busy: dict[int, Job], free: list[int], jobs: deque) -> None:
        """Pages for each row's next round; if short, the newest rows give theirs back and requeue first."""
        ps, held = self.core.cache.page, self.book.held
        wants = {r: w for r in busy  # only rows whose next tokens cross into a page they lack
                 for w in (min(self._at[r] + self.sync_every, self._need[r]),) if w > len(held[r]) * ps}
        short = sum(self.book.missing(r, s) for r, s in wants.items()) - len(self.book.free)
        back: list[int] = []
        while short > 0 and len(busy) > 1:
            r = max(busy, key=self._seq.__getitem__)
            short -= self.book.missing(r, wants.pop(r, 0)) + len(held[r])
            back.append(r)
            jobs.appendleft(busy.pop(r))
            free.append(r)
        if short > 0:
            raise RuntimeError(f"paged KV: {self.book.total} pages do not hold one row's next tokens")
        if back:
            self.book.release(back)
            self.done[torch.tensor(back, device=self.core.device)] = True
            self.preempted += len(back)
        self.book.grow(wants)

    def _fill(self, take: list[tuple[int, Job]]) -> None:
        """Prefill `take` sorted by length; a part is packed where that computes fewer attention
        scores than left padding (T^2 < R * W^2: packed attention is quadratic in the total)."""
        take = sorted(take, key=lambda t: len(t[1].prompt))
        if self.prefill is not None:
            pack: list[tuple[int, Job]] = []
            tokens = 0
            for r, j in take:
                if len(j.prompt) > self.prefill.limit:
                    self._prefill([(r, j)], packed=False)
                    continue
                if pack and tokens + len(j.prompt) > self.prefill.limit:
                    self._prefill_pack(pack)
                    pack, tokens = [], 0
                pack.append((r, j))
                tokens += len(j.prompt)
            if pack:
                self._prefill_pack(pack)
            return
        for i in range(0, len(take), 64):
            part = take[i:i + 64]
            lens = [len(j.prompt) for _, j in part]
            t = sum(lens)
            self._prefill(part, packed=t * t < len(lens) * max(lens) ** 2 and t <= self.prefill_tokens)

    def _prefill_pack(self, part: list[tuple[int, Job]]) -> None:
        dev = self.core.device
        first = self.prefill([r for r, _ in part], [j.prompt for _, j in part])
        lens = torch.tensor([len(j.prompt) for _, j in part], device=dev)
        self._begin(part, torch.tensor([r for r, _ in part], device=dev), first, lens, torch.zeros_like(lens))
        self.packed_prefills += 1

    def _prefill(self, part: list[tuple[int, Job]], packed: bool) -> None:
        dev = self.core.device
        rows = torch.tensor([r for r, _ in part], device=dev)
        lens = torch.tensor([len(j.prompt) for _, j in part], device=dev)
        if packed:
            first = self.pick(self.core.fresh_packed(rows, [j.prompt for _, j in part]))
            off = torch.zeros_like(lens)
        else:
            W = int(lens.max())
            ids = torch.tensor([[0] * (W - len(j.prompt)) + j.prompt for _, j in part], device=dev)
            off = W - lens
            logits, _ = self.core.fresh(rows, ids, off)
            first = self.pick(logits[:, -1])
            if self.core.paged:  # the paged cache keeps no padding: each prompt from slot 0
                off = torch.zeros_like(off)
            else:
                lens = torch.full_like(lens, W)
        self._begin(part, rows, first, lens, off)
        self.packed_prefills += packed

    def _begin(self, part: list[tuple[int, Job]], rows: torch.Tensor, first: torch.Tensor, start: torch.Tensor,
               off: torch.Tensor) -> None:
        """Set the just-prefilled rows' state: first token, next slot `start`, padding `off`."""
        lim = torch.tensor([min(j.max_new or self.max_new, self.max_new) for _, j in part], device=self.core.device)
        self.prefills += 1
        self.tok[rows] = first
        self.start[rows] = start
        self.off[rows] = off
        self.n[rows] = 1
        self.out[rows, 0] = first
        self.limit[rows] = lim
        self.done[rows] = torch.isin(first, self.stops) | (lim <= 1)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


class Sampler:
    """Samples softmax(logits / T) (top_k > 0: among the k likeliest) by Gumbel-max, argmax(logits / T + G):
    no host sync, so it runs inside the decode step's CUDA graph; seed with torch.manual_seed."""

    def __init__(self, temperature: float = 1.0, top_k: int = 0):
        if not temperature > 0 or top_k < 0:
            raise ValueError(f"temperature {temperature} must be > 0 and top_k {top_k} >= 0")
        self.temperature, self.top_k = temperature, top_k

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits.float() / self.temperature
        if self.top_k and self.top_k < x.shape[-1]:
            kth = x.topk(self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        u = torch.rand(x.shape, device=x.device).clamp_(min=torch.finfo(torch.float32).tiny)
        return (x - torch.log(-torch.log(u))).argmax(-1)


def greedy_generate(model: nn.Module, prompts: list[list[int]], *, max_new_tokens: int, stop_ids: Iterable[int],
                    batch_size: int = 16, graphs: bool | None = None, sync_every: int = 8) -> list[list[int]]:
    """Each prompt's greedy continuation (see GreedyDecoder), `batch_size` rows at a time."""
    if not prompts:
        return []
    dec = GreedyDecoder(model, rows=min(batch_size, len(prompts)), max_prompt=max(len(p) for p in prompts),
                        max_new_tokens=max_new_tokens, stop_ids=stop_ids, graphs=graphs, sync_every=sync_every)
    return dec.generate(prompts)
