"""The evaluation core dflash-eval and real tau during training share: prompts read and
tokenised, each decoded by the target alone and with the drafter (speculative.py), and the
report of acceptance length tau, drafted vs accepted tokens, speedup and whether both
outputs agree token for token.

Greedy speculative decoding is lossless, but in bf16 a block verified in one pass can round a
near-tie differently from one-at-a-time decoding: such a difference within the tie tolerance is
a tie-flip (docs/EVAL.md), beyond it a mismatch."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.consumers.export.export import Drafter, ExportError
from dflash.decoding.ties import TIE_TOLERANCE, divergence, first_difference, is_tie_flip
from dflash.runtime.progress import progress

from .speculative import Generation, Speculative, TargetGreedy


@dataclass
class Prompt:
    name: str
    ids: list[int]


# ---------------------------------------------------------------- inputs


def read_prompts(path: str | Path, tokenizer, limit: int | None = None) -> list[Prompt]:
    """Token IDs of every prompt in a JSON Lines file. Raises ValueError naming FILE:LINE."""
    out: list[Prompt] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{Path(path).name}:{n}"
        try:
            row = json.loads(line)
            ids = prompt_ids(row, tokenizer)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: not a prompt row ({type(e).__name__}: {e})") from None
        if not ids:
            raise ValueError(f"{where}: the prompt is empty once tokenised")
        out.append(Prompt(str(row.get("id", where)), ids))
        if limit is not None and len(out) >= limit:
            break
    return out


def prompt_ids(row: dict, tokenizer) -> list[int]:
    if "messages" in row:
        msgs = row["messages"]
        # a chat ending in a user turn awaits its answer whole; one with answers is cut before the first
        first = len(msgs) if msgs and msgs[-1]["role"] == "user" else \
            next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
        if first == 0:
            raise ValueError("no turn before the first assistant turn")
        text = tokenizer.apply_chat_template(msgs[:first], tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    text = row["prompt"] if "prompt" in row else row["text"]
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def stop_ids(model, tokenizer) -> set[int]:
    """The generation config's eos IDs (chat models end a turn on e.g. <|im_end|>), else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


def check_pair(model, drafter: Drafter) -> None:
    """Raise ExportError if the drafter was not made for this target's shape."""
    cfg = model.config.get_text_config()
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    if drafter.num_target_layers and drafter.num_target_layers != L:
        raise ExportError(f"drafter was trained on a {drafter.num_target_layers}-layer target, this one has {L}")
    if max(drafter.target_layer_ids) > L - 2:
        raise ExportError(f"target_layer_ids {drafter.target_layer_ids} exceed this target's layers 0..{L - 2}")
    if drafter.model.cfg.hidden_size != D:
        raise ExportError(f"drafter hidden size {drafter.model.cfg.hidden_size} != target's {D}")
    if not 0 <= drafter.mask_token_id < model.get_input_embeddings().weight.shape[0]:
        raise ExportError(f"mask_token_id {drafter.mask_token_id} is outside the target's vocabulary")


# ---------------------------------------------------------------- evaluation


def resolve_tie_tolerance(dtype: torch.dtype, given: float | None) -> float | None:
    """The logit margin within which a difference is a tie-flip; None (float32): none is."""
    if dtype in (torch.float32, torch.float64):
        if given:
            raise ValueError(f"--tie-tolerance {given}: {dtype} decoding must be exact (no tie-flips allowed)")
        return None
    if given is not None and given < 0:
        raise ValueError(f"--tie-tolerance {given} must be >= 0")
    return TIE_TOLERANCE[dtype] if given is None else given


def evaluate(model, drafter: Drafter, prompts: list[Prompt], *, max_new_tokens: int, stops: set[int],
             warmup: bool = True, tolerance: float | None = None) -> dict:
    """Decode every prompt both ways; the report (`summarise`). Differences are listed, not raised."""
    if not prompts:
        return summarise([], drafter.block_size)
    longest = max(len(p.ids) for p in prompts)
    base_dec = TargetGreedy(model, max_prompt=longest, max_new_tokens=max_new_tokens, stop_ids=stops)
    spec_dec = Speculative(model, drafter, max_prompt=longest, max_new_tokens=max_new_tokens, stop_ids=stops)
    if warmup:  # first calls pay one-off costs (allocator, kernel selection): not the method's
        base_dec(prompts[0].ids)
        spec_dec(prompts[0].ids)
    rows = []
    with progress("eval: decode each prompt alone and with the drafter", len(prompts), "prompt") as bar:
        for p in prompts:
            base = base_dec(p.ids)
            spec = spec_dec(p.ids)
            div = divergence(model, p.ids, base.tokens, spec.tokens) if base.tokens != spec.tokens else None
            rows.append(prompt_report(p, base, spec, drafter.block_size, div, tolerance))
            cycles = sum(r["cycles"] for r in rows)
            bar.note(tau=round(sum(r["tau"] for r in rows) / len(rows), 3),
                     lossless=f"{sum(r['lossless'] or r['tie_flip'] for r in rows)}/{len(rows)}", cycles=cycles)
            bar.update()
    return summarise(rows, drafter.block_size, tolerance)


def prompt_report(p: Prompt, base: Generation, spec: Generation, block_size: int, div: dict | None = None,
                  tolerance: float | None = None) -> dict:
    """One prompt's figures; a difference without `div` (its margins) is a mismatch."""
    lossless = base.tokens == spec.tokens
    row = {
        "prompt": p.name, "prompt_tokens": len(p.ids), "new_tokens": len(spec.tokens), "cycles": len(spec.accept_lengths),
        "tau": round(sum(spec.accept_lengths) / max(1, len(spec.accept_lengths)), 4),
        "tau_hist": histogram(spec.accept_lengths, block_size), "drafted": spec.drafted, "accepted": spec.accepted,
        "target_passes": {"target_only": base.target_passes, "speculative": spec.target_passes},
        "target_s": round(base.seconds, 4), "speculative_s": round(spec.seconds, 4),
        "speedup": round(base.seconds / spec.seconds, 4) if spec.seconds > 0 else None,
        "lossless": lossless, "tie_flip": False,
    }
    if not lossless:
        row["first_difference"] = div["index"] if div else first_difference(base.tokens, spec.tokens)
        row["top2_margin"] = _round(div["top2_margin"]) if div else None
        row["flip_margin"] = _round(div["flip_margin"]) if div else None
        row["tie_flip"] = tolerance is not None and is_tie_flip(div, tolerance)
    return row


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 5)


def histogram(lengths: list[int], block_size: int) -> list[int]:
    """counts[k-1] = cycles that committed k tokens, k = 1..B."""
    c = Counter(lengths)
    return [c.get(k, 0) for k in range(1, block_size + 1)]


def summarise(rows: list[dict], block_size: int, tolerance: float | None = None) -> dict:
    cycles = sum(r["cycles"] for r in rows)
    hist = [sum(col) for col in zip(*(r["tau_hist"] for r in rows))] if rows else [0] * block_size
    committed = sum(k * n for k, n in enumerate(hist, 1))
    t_base, t_spec = sum(r["target_s"] for r in rows), sum(r["speculative_s"] for r in rows)
    drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
    return {
        "block_size": block_size, "prompts": len(rows), "cycles": cycles,
        # As the reference benchmark reports it: the mean over prompts of each prompt's mean.
        "tau": round(sum(r["tau"] for r in rows) / len(rows), 4) if rows else None,
        "tau_pooled": round(committed / cycles, 4) if cycles else None, "tau_hist": hist,
        "drafted": drafted, "accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "new_tokens": sum(r["new_tokens"] for r in rows),
        "target_s": round(t_base, 4), "speculative_s": round(t_spec, 4),
        "speedup": round(t_base / t_spec, 4) if t_spec > 0 else None,
        "mismatches": [r["prompt"] for r in rows if not r["lossless"] and not r["tie_flip"]],
        "tie_flips": [r["prompt"] for r in rows if r["tie_flip"]], "tie_tolerance": tolerance,
        "per_prompt": rows,
    }
