"""A local Hugging Face hub cache holding one model under a hub ID, in the layout
huggingface_hub writes (models--org--name/{refs/main, snapshots/<commit>/...}), so that a
command given `--target org/name` finds it through huggingface_hub's own offline lookup."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def put_in_hub_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """Copy `folder`'s files into `cache` as the snapshot of `repo_id`; returns the snapshot."""
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for f in Path(folder).iterdir():
        if f.is_file():
            shutil.copy2(f, snap / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snap


def hub_env(cache: Path) -> dict:
    """Environment for a subprocess to use `cache` as its hub cache, offline."""
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
            **{k: v for k, v in os.environ.items() if k == "PATH"}}
