"""dflash-eval: real speculative decoding (greedy) of a target with a DFlash drafter.

For every prompt it decodes twice, target alone and target + drafter, and reports the
acceptance length tau (tokens committed per draft/verify cycle, bonus included: mean and
histogram), drafted vs accepted tokens and the wall-clock speedup. Both outputs must be
identical token for token (greedy speculative decoding is lossless); a difference beyond
`--tie-tolerance` (any in float32) exits 1, naming the prompts (docs/EVAL.md). The
decoding, the prompts' format and the report are consumers/evaluation/evaluate.py's; this
module is the command's side: loading the pair, the printed report, the exit status.

Progress (loading both models, then each prompt decoded both ways, with the running tau)
is a bar on a terminal and `progress.update` log lines on stderr otherwise: stdout is the
report alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import torch

from dflash.consumers.evaluation.evaluate import check_pair, evaluate, read_prompts, resolve_tie_tolerance, stop_ids
from dflash.consumers.export.export import ExportError, check_drafter_target, load_exported
from dflash.runtime.command_line import fail


# ---------------------------------------------------------------- the report


def format_report(rep: dict) -> str:
    lines = [f"{'prompt':<28} {'new':>5} {'cycles':>6} {'tau':>6} {'acc/drafted':>12} {'speedup':>8}  lossless"]
    for r in rep["per_prompt"]:
        same = "yes" if r["lossless"] else (f"tie-flip at {r['first_difference']} (margin {r['flip_margin']})"
                                            if r["tie_flip"] else f"NO at {r['first_difference']} "
                                            f"(margin {r.get('flip_margin')})")
        lines.append(f"{r['prompt'][:28]:<28} {r['new_tokens']:>5} {r['cycles']:>6} {r['tau']:>6.2f} "
                     f"{r['accepted']:>5}/{r['drafted']:<6} {r['speedup'] or 0:>7.2f}x  {same}")
    lines.append(f"overall: tau {rep['tau']} (mean of prompts; {rep['tau_pooled']} over all cycles; "
                 f"B={rep['block_size']}), accepted {rep['accepted']}/{rep['drafted']} "
                 f"drafted, speedup {rep['speedup']}x ({rep['target_s']} s -> {rep['speculative_s']} s), "
                 f"{len(rep['mismatches'])} mismatch(es), {len(rep['tie_flips'])} tie-flip(s) "
                 + ("(float32: none allowed)" if rep["tie_tolerance"] is None
                    else f"within logit margin {rep['tie_tolerance']}"))
    lines.append("tau histogram (k=1..B): " + " ".join(f"{k}:{n}" for k, n in enumerate(rep["tau_hist"], 1) if n))
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def drafter_folder(ref: str, runs_dir: str) -> str:
    """--drafter as a folder: an export or step folder as given, else the checkpoint that
    `latest`, a run ID or a run folder names (as dflash-export resolves it)."""
    from dflash.consumers.checkpoints.checkpoint import resolve_checkpoint

    p = Path(ref)
    if p.is_dir() and ((p / "config.json").is_file() or (p / "state.json").is_file()):
        return ref
    try:
        return str(resolve_checkpoint(ref, runs_dir))
    except FileNotFoundError as e:
        raise FileNotFoundError(str(e).replace("--resume", "--drafter")) from None


def load_pair(target: str, drafter_dir: str, dtype: str, device: str):
    """(target model, tokenizer, drafter), both models frozen in `dtype` on `device`."""
    from transformers.utils import logging as hf_logging

    from dflash.runtime import targets

    hf_logging.disable_progress_bar()  # a report, not a loading bar, is this command's output
    torch_dtype = _DTYPES[dtype]
    model = targets.load_causal_lm(target, dtype=torch_dtype).to(device).eval().requires_grad_(False)
    tokenizer = targets.load_tokenizer(target)
    drafter = load_exported(drafter_dir, device=device, dtype=torch_dtype)
    check_pair(model, drafter)
    check_drafter_target(drafter_dir, target)  # trained for this very target (its heads hash)
    return model, tokenizer, drafter


def run(target, drafter, runs_dir, prompts, max_new_tokens, limit, device, dtype, threads, tie_tolerance,
        as_json, fuse: str = "auto") -> None:
    """dflash-eval (tools/eval_command.py parses its options)."""
    from dflash.runtime.logs import setup_logging

    setup_logging("tool", "eval", stream=sys.stderr)  # stdout is the report alone
    if threads:
        torch.set_num_threads(threads)
    enable_fused(fuse, torch.device(device))
    try:
        tolerance = resolve_tie_tolerance(_DTYPES[dtype], tie_tolerance)
        drafter = drafter_folder(drafter, runs_dir)
        model, tokenizer, d = load_pair(target, drafter, dtype, device)
        rows = read_prompts(prompts, tokenizer, limit)
    except (ExportError, ValueError, OSError) as e:
        fail(str(e))
    rep = evaluate(model, d, rows, max_new_tokens=max_new_tokens, stops=stop_ids(model, tokenizer),
                   tolerance=tolerance)
    click.echo(json.dumps(rep) if as_json else format_report(rep))
    if rep["mismatches"]:
        click.echo(f"error: speculative output differs from target-only greedy output "
                   f"{'at all' if tolerance is None else f'beyond the tie tolerance {tolerance}'} for prompt(s): "
                   f"{', '.join(rep['mismatches'])}", err=True)
        sys.exit(1)


def enable_fused(fuse: str, device: torch.device) -> bool:
    """The drafter's fused kernels for decoding (`--fuse`): at batch 1 a cycle is bound by
    kernel launches, and fusion launches fewer; auto takes them where training would."""
    from dflash.consumers.drafter import fused
    from dflash.consumers.training.train import auto_compiles

    on = fuse == "on" or (fuse == "auto" and auto_compiles(device))
    fused.enable(on)
    return on
