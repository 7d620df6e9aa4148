"""How a generated answer ends, and a detector of degenerate repetition (issue 35).

A small target decoded greedily often ends in a loop: the same stretch of tokens again and
again until the token cap. `EndingRule` says what counts as a loop: the answer's last
tokens repeat one block of `p` tokens (p <= `max_period`), the repeating stretch at least
`tail` tokens long and at least `repeats` copies of the block. Natural repeats (a list's
items, a table's separator row, a short refrain) are shorter than that or differ in a token
(item numbers), so they do not count.

Two implementations of one rule, which the tests hold equal: `looping` / `repetition_cut`
on a token list (pure Python, for classifying finished answers), and `looping_rows` on a
decoder's output tensor (torch, for stopping looping rows at the decoder's sync points
without copying their tokens to the host). Where a loop is cut, one copy of the block is
kept: the target did say it once; what follows it is the loop.

Reasons (`classify`): `eos` the answer ended with a stop token; `repetition` it looped and
is cut; `cap` it ran to the token cap without looping (unfinished).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EOS, REPETITION, CAP = "eos", "repetition", "cap"
REASONS = (EOS, REPETITION, CAP)


@dataclass(frozen=True)
class EndingRule:
    """A loop: the last `max(tail, repeats * p)` tokens have period p, for a p <= max_period."""

    tail: int = 64
    max_period: int = 64
    repeats: int = 3

    def __post_init__(self):
        if self.max_period < 1 or self.repeats < 2 or self.tail < 2:
            raise ValueError(f"ending rule {self}: max_period must be >= 1, repeats >= 2, tail >= 2")

    def span(self, p: int) -> int:
        """The periodic stretch a loop of period p needs."""
        return max(self.tail, self.repeats * p)

    @property
    def window(self) -> int:
        """The most trailing tokens the rule ever looks at."""
        return self.span(self.max_period)

    def describe(self) -> str:
        return f"tail={self.tail},max_period={self.max_period},repeats={self.repeats}"


def _runs(ids: list[int], max_period: int) -> list[int]:
    """For each period p (index p), how many trailing positions i have ids[i] == ids[i - p]."""
    n = len(ids)
    runs = [0] * (max_period + 1)
    for p in range(1, min(max_period, n - 1) + 1):
        k = 0
        while k < n - p and ids[n - 1 - k] == ids[n - 1 - k - p]:
            k += 1
        runs[p] = k
    return runs


def loop_period(ids: list[int], rule: EndingRule) -> int | None:
    """The smallest period p whose trailing periodic stretch (run + p tokens) makes a loop by
    `rule`, else None."""
    runs = _runs(ids, rule.max_period)
    for p in range(1, len(runs)):
        if runs[p] + p >= rule.span(p):
            return p
    return None


def looping(ids: list[int], rule: EndingRule) -> bool:
    return loop_period(ids, rule) is not None


def repetition_cut(ids: list[int], rule: EndingRule) -> int | None:
    """Where to cut a looping answer (its length up to and including the loop's first copy of
    the block), else None. The loop starts where the trailing periodic stretch starts."""
    runs = _runs(ids, rule.max_period)
    for p in range(1, len(runs)):
        if runs[p] + p >= rule.span(p):
            return len(ids) - runs[p]  # stretch start (len - run - p) plus one block
    return None


def decoded_ending(ids: list[int], stop_ids, rule: EndingRule | None, sync_every: int = 8) -> tuple[str, int, int]:
    """What GreedyDecoder with `ending=rule` and endings.classify make of an answer whose uncut
    greedy continuation is `ids`: (reason, length kept, tokens decoded). The decoder checks
    each row at its sync points, after n = 1 + k * sync_every tokens, so a loop that breaks
    off between two checks is not seen there (only, if still looping, at the cap).
    Incremental: O(len * max_period)."""
    n_all = len(ids)
    ends = bool(ids) and ids[-1] in stop_ids
    if rule is not None:
        runs = [0] * (rule.max_period + 1)
        for n in range(1, n_all + 1):
            t = n - 1
            for p in range(1, min(rule.max_period, t) + 1):
                runs[p] = runs[p] + 1 if ids[t] == ids[t - p] else 0
            if n % sync_every != 1 % sync_every or (n == n_all and ends):
                continue
            for p in range(1, min(rule.max_period, t) + 1):
                if runs[p] + p >= rule.span(p):
                    return REPETITION, n - runs[p], n
    reason, keep = classify(ids, stop_ids, rule)
    return reason, keep, n_all


def classify(ids: list[int], stop_ids, rule: EndingRule | None) -> tuple[str, int]:
    """(reason, length to keep) of one finished answer: `eos` when it ends with a stop token
    (kept whole, whatever repeats in it), else `repetition` with its cut when `rule` finds a
    loop, else `cap` (kept whole)."""
    if ids and ids[-1] in stop_ids:
        return EOS, len(ids)
    cut = repetition_cut(ids, rule) if rule is not None else None
    if cut is not None:
        return REPETITION, cut
    return CAP, len(ids)


def looping_rows(out: torch.Tensor, n: torch.Tensor, rule: EndingRule) -> torch.Tensor:
    """`looping` for every row of a decoder's output: `out` [rows, max_new] holds row r's
    tokens in out[r, :n[r]]. Returns bool [rows]. Only the last `rule.window` tokens of each
    row are read; elementwise ops on the device, no synchronisation."""
    W = min(rule.window, out.shape[1])
    rows = out.shape[0]
    pos = n[:, None] - W + torch.arange(W, device=out.device)  # the window's positions, oldest first
    win = out.gather(1, pos.clamp(0, out.shape[1] - 1))
    valid = pos >= 0
    found = torch.zeros(rows, dtype=torch.bool, device=out.device)
    for p in range(1, min(rule.max_period, W - 1) + 1):
        need = rule.span(p) - p  # trailing positions i with ids[i] == ids[i - p]
        if need > W - p:
            continue
        same = (win[:, W - need:] == win[:, W - need - p:W - p]) & valid[:, W - need - p:W - p]
        found |= same.all(1)
    return found
