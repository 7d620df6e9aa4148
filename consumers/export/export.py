"""dflash-export: a checkpoint as the DFlash authors publish their drafters, and the loader
that reads such a folder back (ours or theirs).

The published layout (docs/EXPORT.md): config.json, a Qwen3 config plus `block_size` and
`dflash_config`, and bf16 model.safetensors without embedding or LM head (the target's are used)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import click
import torch
from safetensors.torch import save_file

from dflash.consumers.checkpoints.checkpoint import resolve_checkpoint
from dflash.consumers.checkpoints.integrity import CheckpointDamaged, load_weights, read_manifest, verify_checkpoint, write_manifest
from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig, fold_feature_scale
from dflash.protocol.errors import DFlashError
from dflash.runtime import targets
from dflash.runtime.command_line import fail
from dflash.runtime.run import write_json_atomic

from . import hf_dflash
from .export_card import model_card, read_eval_report


class ExportError(DFlashError):
    """A folder is not a drafter in the published layout, or not one this code can run."""


@dataclass
class Drafter:
    """A loaded drafter and what an engine needs to drive it."""

    model: DFlashDraft
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    config: dict


# ---------------------------------------------------------------- config.json


def _target_token_ids(target: str | os.PathLike | None) -> tuple[int | None, int | None]:
    """bos/eos IDs from the target's config.json or .gguf metadata (informational)."""
    if target is None:
        return None, None
    if targets.gguf_path(target) is not None:
        cfg = targets.load_config(target).to_dict()
    else:
        cfg = json.loads((Path(target) / "config.json").read_text())
    cfg = {**cfg, **cfg.get("text_config", {})}
    return cfg.get("bos_token_id"), cfg.get("eos_token_id")


def export_config(ckpt: dict, *, bos_token_id=None, eos_token_id=None) -> dict:
    """Our checkpoint config.json -> the published key set (`rope_parameters` dropped: transformers
    5 rebuilds it, 4.x never knew it)."""
    from transformers import __version__ as tf_version

    n = int(ckpt["num_hidden_layers"])
    out = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": int(ckpt["block_size"]),
        "bos_token_id": bos_token_id,
        "dflash_config": {"mask_token_id": int(ckpt["dflash_config"]["mask_token_id"]),
                          "target_layer_ids": [int(i) for i in ckpt["dflash_config"]["target_layer_ids"]]},
        "dtype": "bfloat16",
        "eos_token_id": eos_token_id,
        "head_dim": int(ckpt["head_dim"]),
        "hidden_act": "silu",
        "hidden_size": int(ckpt["hidden_size"]),
        "initializer_range": 0.02,
        "intermediate_size": int(ckpt["intermediate_size"]),
        "layer_types": ["full_attention"] * n,
        "max_position_embeddings": int(ckpt["max_position_embeddings"]),
        "max_window_layers": n,
        "model_type": "qwen3",
        "num_attention_heads": int(ckpt["num_attention_heads"]),
        "num_hidden_layers": n,
        "num_key_value_heads": int(ckpt["num_key_value_heads"]),
        "num_target_layers": int(ckpt["num_target_layers"]),
        "rms_norm_eps": float(ckpt["rms_norm_eps"]),
        "rope_scaling": None,
        "rope_theta": _rope_theta(ckpt),
        "sliding_window": None,
        "tie_word_embeddings": False,  # no embedding or LM head: nothing is tied
        "transformers_version": tf_version,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": int(ckpt["vocab_size"]),
    }
    return out


def _rope_theta(cfg: dict) -> float:
    # transformers 5 nests rope_theta in rope_parameters; published (4.x) configs keep it top level.
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ExportError("config.json has no rope_theta")
    return float(theta)


def drafter_config(cfg: dict) -> DrafterConfig:
    """The model shape from a published config.json; ExportError for one not run faithfully here."""
    if "DFlashDraftModel" not in (cfg.get("architectures") or []):
        raise ExportError(f"architectures {cfg.get('architectures')} is not DFlashDraftModel")
    n = int(cfg["num_hidden_layers"])
    if any(t != "full_attention" for t in cfg.get("layer_types") or ["full_attention"] * n):
        raise ExportError(f"layer_types {cfg.get('layer_types')}: only full_attention drafters are supported")
    scaling = cfg.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or (cfg.get("rope_parameters") or {}).get("rope_type")
    if rope_type not in (None, "default"):
        raise ExportError(f"RoPE scaling {rope_type!r} is not supported (the drafter uses plain RoPE)")
    if cfg.get("attention_bias"):
        raise ExportError("attention_bias drafters are not supported")
    ids = (cfg.get("dflash_config") or {}).get("target_layer_ids")
    if not ids:
        raise ExportError("config.json lacks dflash_config.target_layer_ids")
    heads = int(cfg["num_attention_heads"])
    return DrafterConfig(
        hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]),
        num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads), num_layers=n,
        num_features=len(ids), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(cfg),
    )


# ---------------------------------------------------------------- export / load


def export_checkpoint(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                      target: str | os.PathLike | None = None, overwrite: bool = False,
                      eval_report: dict | None = None) -> Path:
    """Write `out_dir` from a checkpoint folder, via a temporary sibling renamed at the end, so a
    reader never sees half an export."""
    src, out = Path(ckpt_dir), Path(out_dir)
    if not (src / "config.json").is_file() or not (src / "model.safetensors").is_file():
        raise ExportError(f"{src} has no config.json + model.safetensors (not a drafter checkpoint)")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} exists and is not empty (pass --force to replace it)")
    verify_checkpoint(src)  # a damaged file is refused here, naming it, before anything is written
    ckpt_cfg = json.loads((src / "config.json").read_text())
    cfg = export_config(ckpt_cfg, **dict(zip(("bos_token_id", "eos_token_id"), _target_token_ids(target))))
    model = DFlashDraft(drafter_config(cfg))
    weights = fold_feature_scale(load_weights(src / "model.safetensors"))
    _check_names(weights, model)
    # bf16 as published; contiguous copies because safetensors refuses views.
    weights = {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(weights.items())}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-export-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        os.chmod(tmp / "model.safetensors", 0o644)  # safetensors creates 0600; an export is for sharing
        write_json_atomic(tmp / "config.json", cfg)
        _write_remote_code(tmp, cfg, src, target, out.name, eval_report)
        # last (it hashes the others): the target the drafter was trained for, which dflash-eval checks
        write_manifest(tmp, {"target": drafter_target(src), "source": str(src.resolve())})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_remote_code(folder: Path, cfg: dict, src: Path, target, name: str, eval_report: dict | None) -> None:
    """dflash.py and README.md, so the folder loads with transformers alone."""
    (folder / "dflash.py").write_text(Path(hf_dflash.__file__).read_text())
    state = json.loads((src / "state.json").read_text()) if (src / "state.json").is_file() else {}
    (folder / "README.md").write_text(model_card(cfg, state, name=name, target=str(target) if target else None,
                                                 eval_report=eval_report))
    for f in ("dflash.py", "README.md", "config.json"):
        os.chmod(folder / f, 0o644)


def _check_names(weights: dict, model: DFlashDraft) -> None:
    # feature_scale is optional: the published layout folds it into fc.weight
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "feature_scale" or k in weights}
    have = {k: tuple(v.shape) for k, v in weights.items()}
    if want != have:
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        wrong = sorted(k for k in set(want) & set(have) if want[k] != have[k])
        raise ExportError(f"weights do not match the config: missing {missing[:4]}, unexpected {extra[:4]}, "
                          f"wrong shape {[(k, have[k], want[k]) for k in wrong[:4]]}")


def load_exported(path: str | os.PathLike, *, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> Drafter:
    """Our drafter from a published-layout folder: an export, a training checkpoint or the authors'."""
    folder = Path(path)
    verify_checkpoint(folder)  # ours carry manifest.json; a published drafter has none
    cfg = json.loads((folder / "config.json").read_text())
    model = DFlashDraft(drafter_config(cfg))
    weights = load_weights(folder / "model.safetensors")
    weights = {k.removeprefix("model."): v for k, v in weights.items()}  # some trainers save a prefix
    _check_names(weights, model)
    model.load_state_dict(weights, strict=True)
    model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    dc = cfg["dflash_config"]
    if dc.get("mask_token_id") is None:
        raise ExportError(f"{folder}: dflash_config.mask_token_id is missing (a guessed one silently lowers acceptance)")
    block = dc.get("block_size", cfg.get("block_size", 16))
    return Drafter(model, int(block), int(dc["mask_token_id"]), [int(i) for i in dc["target_layer_ids"]],
                   int(cfg.get("num_target_layers") or 0), cfg)


def drafter_target(folder: str | os.PathLike) -> dict | None:
    """The target identity a drafter folder records, or None (a drafter published by others)."""
    folder = Path(folder)
    state = folder / "state.json"
    if state.is_file():
        return (json.loads(state.read_text()).get("signal") or {}).get("target")
    manifest = read_manifest(folder)
    return manifest.get("target") if manifest else None


def check_drafter_target(drafter_dir: str | os.PathLike, target_dir: str | os.PathLike) -> dict | None:
    """ExportError for a drafter trained for another target; the recorded identity (or None)."""
    from dflash.protocol.target_id import describe_target, same_target
    from dflash.runtime.target_heads import TargetLoadError, identity_of

    want = drafter_target(drafter_dir)
    if want is None:
        return None
    try:
        have = identity_of(target_dir)
    except TargetLoadError as e:
        raise ExportError(f"--target {target_dir}: cannot check it is the drafter's target ({e})") from None
    if not same_target(want, have):
        raise ExportError(f"drafter {drafter_dir} was trained for target {describe_target(want)}, but --target "
                          f"{target_dir} is {describe_target(have)}: evaluate it with the target it was trained for")
    return want


# ---------------------------------------------------------------- CLI


def run(checkpoint: str, out_dir: str, target: str | None, runs_dir: str, force: bool,
        eval_report: str | None) -> None:
    """dflash-export (consumers/export/export_command.py parses its options)."""
    try:
        report = read_eval_report(eval_report) if eval_report else None
        src = resolve_checkpoint(checkpoint, runs_dir)
        out = export_checkpoint(src, out_dir, target=target, overwrite=force, eval_report=report)
    except KeyError as e:
        fail(f"{checkpoint}: config.json lacks {e}")
    except (ExportError, CheckpointDamaged, FileNotFoundError, json.JSONDecodeError, ValueError) as e:
        fail(str(e))
    cfg = json.loads((out / "config.json").read_text())
    click.echo(f"exported {src} -> {out} (block_size {cfg['block_size']}, "
               f"target_layer_ids {cfg['dflash_config']['target_layer_ids']}, "
               f"mask_token_id {cfg['dflash_config']['mask_token_id']})")
