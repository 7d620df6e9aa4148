"""How a generated answer ends, and a detector of degenerate repetition (issue 35).

A loop is a trailing block of p tokens repeated over at least `tail` tokens, long enough that
natural repeats (list items, a refrain) do not count. The rule has a list form (`looping`) and
a device form (`looping_rows`, no host sync); the tests hold them equal. What of a loop is kept
for training is the rule's `keep`: the span that shows the loop (default), or its first copy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

EOS, REPETITION, CAP = "eos", "repetition", "cap"
REASONS = (EOS, REPETITION, CAP)
SPAN, COPY = "span", "copy"  # what of a loop is kept: the repeats that show it, or the block once
KEEPS = (SPAN, COPY)


@dataclass(frozen=True)
class EndingRule:
    """A loop: the last `max(tail, repeats * p)` tokens have period p, for a p <= max_period.
    `keep`: SPAN keeps the loop's start and its repeats over that span (the target does repeat,
    and a drafter that never saw a repeat cannot predict one); COPY keeps the block once."""

    tail: int = 64
    max_period: int = 64
    repeats: int = 3
    keep: str = SPAN

    def __post_init__(self):
        if self.max_period < 1 or self.repeats < 2 or self.tail < 2:
            raise ValueError(f"ending rule {self}: max_period must be >= 1, repeats >= 2, tail >= 2")
        if self.keep not in KEEPS:
            raise ValueError(f"ending rule keep={self.keep!r}: one of {', '.join(KEEPS)}")

    def span(self, p: int) -> int:
        return max(self.tail, self.repeats * p)

    @property
    def window(self) -> int:
        return self.span(self.max_period)

    def describe(self) -> str:
        return f"tail={self.tail},max_period={self.max_period},repeats={self.repeats},keep={self.keep}"

    def kept(self, end: int, run: int, p: int) -> int:
        """Length to keep of a loop of period p whose stretch of `run` repeated positions ends at `end`."""
        start = end - run - p  # the stretch's first token
        return start + (self.span(p) if self.keep == SPAN else p)


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
    """The smallest period that makes a loop by `rule`, else None."""
    runs = _runs(ids, rule.max_period)
    for p in range(1, len(runs)):
        if runs[p] + p >= rule.span(p):
            return p
    return None


def looping(ids: list[int], rule: EndingRule) -> bool:
    return loop_period(ids, rule) is not None


def repetition_cut(ids: list[int], rule: EndingRule) -> int | None:
    """Length to keep of a looping answer (`rule.keep` of the loop), else None."""
    runs = _runs(ids, rule.max_period)
    for p in range(1, len(runs)):
        if runs[p] + p >= rule.span(p):
            return rule.kept(len(ids), runs[p], p)
    return None


def decoded_ending(ids: list[int], stop_ids, rule: EndingRule | None, sync_every: int = 8) -> tuple[str, int, int]:
    """(reason, kept, decoded) that GreedyDecoder with `ending=rule` gives `ids`: it checks only at
    sync points (n = 1 + k * sync_every), so a loop broken off between two is not seen."""
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
                    return REPETITION, rule.kept(n, runs[p], p), n
    reason, keep = classify(ids, stop_ids, rule)
    return reason, keep, n_all


def classify(ids: list[int], stop_ids, rule: EndingRule | None) -> tuple[str, int]:
    """(reason, length to keep): `eos` kept whole, `repetition` cut, else `cap` kept whole."""
    if ids and ids[-1] in stop_ids:
        return EOS, len(ids)
    cut = repetition_cut(ids, rule) if rule is not None else None
    if cut is not None:
        return REPETITION, cut
    return CAP, len(ids)


def looping_rows(out: torch.Tensor, n: torch.Tensor, rule: EndingRule) -> torch.Tensor:
    """`looping` of each row's out[r, :n[r]], over its last `rule.window` tokens on the device (no sync)."""
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
