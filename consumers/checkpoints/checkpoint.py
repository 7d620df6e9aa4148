"""Checkpoints: `runs/<run_id>/checkpoints/step-<N>/`, written atomically, the last
`--keep` kept, restored completely by `--resume PATH|latest`.

A folder holds model.safetensors, config.json, optimizer.pt, rng.pt, state.json,
trained.safetensors (record.py) and, written last, manifest.json (integrity.py: a damaged file
is refused naming it). Resuming with another training signal is refused unless forced."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dflash.protocol.training_signal import Signal, SignalMismatch, signal_differences
from dflash.runtime.run import is_run_id, runs_root, write_json_atomic

from .integrity import CheckpointDamaged, check_finite, load_weights, verify_checkpoint, write_manifest
from .record import save_record


STEP_RE = re.compile(r"^step-(\d+)$")


def check_signal(saved: dict, current: Signal, *, force: bool, where: str) -> list[str]:
    """Raise SignalMismatch if the signal changed and not `force`; return the differences."""
    diffs = signal_differences(saved, current)
    if diffs and not force:
        raise SignalMismatch(
            f"checkpoint {where} was trained with another training signal ({'; '.join(diffs)}); "
            "resume with the same settings, or pass --force to change them on purpose"
        )
    return diffs


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_files(folder: Path) -> None:
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of finished checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_RE.match(p.name)) and p.is_dir()]
    return sorted(found)


def write_checkpoint(
    root: Path,
    step: int,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict,
    *,
    state: dict,
    rng: list[torch.Tensor],
    drafter_config: dict,
    keep: int,
    record: dict | None = None,
) -> Path:
    """Write step-<step>/ atomically (temp folder, fsync, rename), then prune to `keep`."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    weights = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt", "step": str(step)})
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save({"rng": rng}, tmp / "rng.pt")
    write_json_atomic(tmp / "config.json", drafter_config)
    write_json_atomic(tmp / "state.json", {**state, "step": step, "saved_at": time.time()})
    if record is not None:  # in the same folder as the weights: renamed into place with them
        save_record(record, tmp)
    write_manifest(tmp)  # last: it hashes every file above
    _fsync_files(tmp)
    if final.exists():  # re-saving a step (rare: a restarted run) replaces it whole
        old = root / f".old-step-{step}-{os.getpid()}"
        os.replace(final, old)
        shutil.rmtree(old)
    os.replace(tmp, final)
    _fsync_dir(root)
    # keep the one just written: by step number alone, a restart from an earlier point deleted it
    others = [p for _, p in step_dirs(root) if p != final]
    for p in others[:max(0, len(others) - (keep - 1))] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    return final


def newest_checkpoint(runs_dir: str | os.PathLike | None = None) -> Path | None:
    """The newest checkpoint of the newest run that has one (a resumed run gets a new run ID)."""
    root = runs_root(runs_dir)
    runs = sorted((p for p in root.iterdir() if is_run_id(p.name)), reverse=True) if root.is_dir() else []
    for run in runs:
        if found := step_dirs(run / "checkpoints"):
            return found[-1][1]
    return None


def nothing_to_resume(ref: str | None, runs_dir: str | os.PathLike | None = None) -> str | None:
    """Why `--resume latest` starts from scratch (no checkpoint yet), else None: one command then
    serves the first start and every restart."""
    if ref != "latest" or newest_checkpoint(runs_dir) is not None:
        return None
    return (f"--resume latest: no checkpoint under {runs_root(runs_dir).resolve()} yet, so nothing to resume: "
            "this consumer starts as it would without --resume")


def resolve_checkpoint(ref: str, runs_dir: str | os.PathLike | None = None) -> Path:
    """A checkpoint folder from `latest`, a run ID, a run folder or a step folder."""
    root = runs_root(runs_dir)
    if ref == "latest":
        if (found := newest_checkpoint(runs_dir)) is not None:
            return found
        raise FileNotFoundError(f"--resume latest: no checkpoint in any run under {root.resolve()}")
    p = Path(ref)
    if not p.exists() and is_run_id(ref):
        p = root / ref
    if (p / "state.json").is_file():
        return p
    for cand in (p / "checkpoints", p):
        if found := step_dirs(cand):
            return found[-1][1]
    raise FileNotFoundError(f"--resume {ref}: not a checkpoint folder, run ID or run folder with checkpoints")


def read_state(path: Path) -> dict:
    return json.loads((path / "state.json").read_text())


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
    """Load weights and optimizer state in place; (state.json dict, per-rank RNG list)."""
    device = next(model.parameters()).device
    weights, opt, rng, saved = read_checkpoint(path, device)
    model.load_state_dict(weights, strict=True)
    optimizer.load_state_dict(opt)
    return saved, rng


def read_checkpoint(path: Path, device) -> tuple[dict, dict, list, dict]:
    """(weights, optimizer state, RNG list, state.json), checked: CheckpointDamaged names a bad file."""
    verify_checkpoint(path)
    weights = load_weights(path / "model.safetensors")
    opt = _torch_load(path / "optimizer.pt", device)
    check_finite(opt.get("state", {}), path / "optimizer.pt")
    rng = _torch_load(path / "rng.pt", "cpu")["rng"]
    return weights, opt, rng, read_state(path)


def _torch_load(file: Path, device) -> dict:
    try:
        return torch.load(file, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise CheckpointDamaged(f"{file} is missing: the checkpoint is incomplete") from None
    except Exception as e:  # a truncated or overwritten pickle fails in many ways
        raise CheckpointDamaged(f"{file} cannot be read ({type(e).__name__}: {str(e)[:200]}): the file is "
                                "damaged; resume from an earlier checkpoint") from None
