"""Checkpoint integrity: a sha256 per file (manifest.json, written at save), checked before
anything is loaded, and finite weights. Every refusal names the file.

Hashes, because flipped bytes inside a tensor still parse (safetensors checks the header only)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dflash.protocol.errors import DFlashError
from dflash.runtime.run import write_json_atomic

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "dflash-manifest-v1"
_CHUNK = 8 << 20


class CheckpointDamaged(DFlashError, ValueError):
    """A checkpoint or drafter file does not hold what was written (hash, size, parse, NaN)."""


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path, extra: dict | None = None) -> dict:
    """Hash every file of `folder` (but the manifest) into manifest.json; return it."""
    files = {p.name: {"sha256": file_sha256(p), "bytes": p.stat().st_size}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")}
    manifest = {"format": MANIFEST_FORMAT, "files": files, **(extra or {})}
    write_json_atomic(folder / MANIFEST, manifest)
    return manifest


def read_manifest(folder: Path) -> dict | None:
    """manifest.json of `folder`, or None if there is none. Raises CheckpointDamaged if unreadable."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest.get("files"), dict):
            raise ValueError("no 'files' map")
        return manifest
    except (ValueError, AttributeError) as e:
        raise CheckpointDamaged(f"{path} is not a manifest ({e}): the folder is damaged") from None


def verify_checkpoint(folder: str | Path) -> bool:
    """Check every file in manifest.json (size, then sha256); False without a manifest."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        return False
    for name, want in sorted(manifest["files"].items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointDamaged(f"{path} is missing (listed in {MANIFEST}): the checkpoint is incomplete")
        size = path.stat().st_size
        if size != want.get("bytes"):
            raise CheckpointDamaged(f"{path} has {size} bytes, {want.get('bytes')} were written (truncated or "
                                    "replaced): use an earlier checkpoint")
        got = file_sha256(path)
        if got != want.get("sha256"):
            raise CheckpointDamaged(f"{path}: content hash sha256 {got[:16]}... differs from the one written at "
                                    f"save ({str(want.get('sha256'))[:16]}...): the file is damaged; use an "
                                    "earlier checkpoint")
    return True


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, all finite. Raises CheckpointDamaged naming `path`."""
    try:
        weights = load_file(path)
    except FileNotFoundError:
        raise CheckpointDamaged(f"{path} is missing") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointDamaged(f"{path} cannot be read as safetensors ({type(e).__name__}: {str(e)[:200]}): "
                                "truncated or damaged; use an earlier checkpoint") from None
    check_finite(weights, path)
    return weights


def check_finite(tensors, where: Path) -> None:
    """CheckpointDamaged naming the first tensor with a NaN or inf in nested dicts or lists."""
    stack = [("", tensors)]
    while stack:
        name, x = stack.pop()
        if isinstance(x, dict):
            stack.extend((f"{name}.{k}" if name else str(k), v) for k, v in x.items())
        elif isinstance(x, (list, tuple)):
            stack.extend((f"{name}[{i}]", v) for i, v in enumerate(x))
        elif isinstance(x, torch.Tensor) and x.is_floating_point() and not bool(torch.isfinite(x).all()):
            bad = int((~torch.isfinite(x)).sum())
            raise CheckpointDamaged(f"{where}: tensor {name} holds {bad} non-finite value(s) (NaN/inf): refusing "
                                    "to load it; use an earlier checkpoint")
