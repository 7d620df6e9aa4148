"""README.md of an export: a model card in the shape of the DFlash authors' drafter cards
(front matter, what it is, how to load it, how it was trained), filled only with what the
checkpoint records (config.json, state.json) and, if given, a dflash-eval report.
A field the checkpoint does not have is written as unknown, never guessed."""

from __future__ import annotations

import json
from pathlib import Path

UNKNOWN = "not recorded"


def _get(d: dict | None, *keys, default=None):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def _target_name(state: dict, target: str | None) -> str | None:
    cfg = state.get("config") or {}
    name = target or cfg.get("target") or _get(cfg, "broker_run_config", "target")
    return str(name) if name else None


def _eval_lines(report: dict | None) -> list[str]:
    if not report:
        return ["Not measured at export time: run `dflash-eval --target TARGET --drafter THIS_FOLDER --prompts "
                "PROMPTS.jsonl` (docs/EVAL.md) and export again with `--eval-report` to record it here."]
    tau, pooled = report.get("tau"), report.get("tau_pooled")
    lines = [f"Acceptance length tau (tokens committed per target verification, bonus included; greedy; "
             f"mean over prompts) **{tau}**, {pooled} pooled over all cycles, on {report.get('prompts')} prompts "
             f"({report.get('new_tokens')} new tokens), block size {report.get('block_size')}.",
             f"Lossless: {'yes, every output equal to the target alone' if not report.get('mismatches') else 'NO'}."]
    if report.get("speedup") is not None:
        lines.append(f"Wall-clock speedup over target-only greedy decoding in that run: {report['speedup']}x.")
    return lines


def model_card(cfg: dict, state: dict, *, name: str, target: str | None = None, eval_report: dict | None = None) -> str:
    """The card's text. `cfg` is the export's config.json, `state` the checkpoint's state.json
    ({} if absent), `target` a target path or hub ID given at export time."""
    tname = _target_name(state, target)
    sig = state.get("signal") or {}
    dc = cfg.get("dflash_config") or {}
    run = _get(state, "config", "broker_run_config") or {}
    ds = run.get("dataset") or {}
    sched = state.get("scheduler") or {}
    data = (f"{ds['n_samples']} samples (dataset fingerprint {ds.get('fingerprint') or UNKNOWN})"
            if ds.get("n_samples") is not None else UNKNOWN)
    rows = [
        ("target", f"`{tname}`" if tname else UNKNOWN),
        ("target model type / layers", f"{_get(sig, 'target', 'model_type', default=UNKNOWN)} / "
                                       f"{cfg.get('num_target_layers', UNKNOWN)}"),
        ("data", data),
        ("epochs (planned)", run.get("epochs", UNKNOWN)),
        ("epoch reached (0-based)", state.get("epoch", UNKNOWN)),
        ("samples / tokens trained", f"{state.get('samples', UNKNOWN)} / {state.get('tokens', UNKNOWN)}"),
        ("optimizer steps", state.get("step", UNKNOWN)),
        ("learning rate", f"peak {sched.get('lr', UNKNOWN)}, warmup {sched.get('warmup', UNKNOWN)}, "
                          f"min {sched.get('min_lr', UNKNOWN)}, schedule steps {sched.get('total_steps', UNKNOWN)}"),
        ("block size", cfg.get("block_size")),
        ("draft layers", cfg.get("num_hidden_layers")),
        ("target layers (features)", dc.get("target_layer_ids")),
        ("mask token ID", dc.get("mask_token_id")),
        ("anchors per sequence", sig.get("anchors", UNKNOWN)),
        ("one anchor per trainable positions", sig.get("anchor_every", 1)),
        ("loss", f"D-PACE, alpha {sig.get('dpace_alpha')}" if sig.get("loss") == "dpace"
                 else f"decayed cross-entropy, gamma {sig.get('gamma', UNKNOWN)}"),
        ("target fingerprint", f"config {_get(sig, 'target', 'config_sha256', default=UNKNOWN)}, "
                               f"heads {_get(sig, 'target', 'heads_sha256', default=UNKNOWN)}"),
    ]
    front = ["---", "library_name: transformers", "tags:", "- dflash", "- speculative-decoding",
             "- block-diffusion", "- draft-model"]
    if tname and not Path(tname).is_absolute():
        front.append(f"base_model: {tname}")
    front.append("---")
    block = cfg.get("block_size")
    body = [
        f"# {name}",
        "",
        f"A DFlash drafter (block diffusion draft model, block size {block}) for "
        f"{'`' + tname + '`' if tname else 'its target'}, trained online with dflash-pipeline. It drafts a block "
        f"of {block} tokens in one forward pass, conditioned on hidden states of target layers "
        f"{dc.get('target_layer_ids')}; the target verifies the block in one pass. Greedy verification is "
        "lossless: the output equals the target's own greedy output.",
        "",
        "It has no embedding and no LM head: it uses the target's. `dflash.py` beside the weights is the model "
        "code (torch and transformers only).",
        "",
        "## Usage",
        "",
        "```python",
        "import torch",
        "from transformers import AutoModel",
        "",
        "draft = AutoModel.from_pretrained(\"THIS_FOLDER\", trust_remote_code=True, dtype=torch.bfloat16).eval()",
        "# draft(position_ids=..., noise_embedding=target_embed(block), target_hidden=features) -> block states;",
        "# apply the target's LM head to them. See dflash.py for the arguments.",
        "```",
        "",
        "The layout is that of the drafters the DFlash authors publish, so their reference inference code "
        "(`dflash/model.py` of z-lab/dflash) and engines that read that layout load it as well.",
        "",
        "## Acceptance length",
        "",
        *_eval_lines(eval_report),
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in rows),
        "",
    ]
    return "\n".join(front + [""] + body)


def read_eval_report(path: str | Path) -> dict:
    """A `dflash-eval --json` report. Raises ValueError naming the file if it is not one."""
    try:
        rep = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a dflash-eval --json report ({e})") from None
    if not isinstance(rep, dict) or "tau" not in rep or "per_prompt" not in rep:
        raise ValueError(f"{path}: not a dflash-eval --json report (no tau / per_prompt)")
    return rep
