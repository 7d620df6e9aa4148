"""Run identity and the run folder: `runs/<run_id>/{logs,checkpoints}/`, run.json, runs/latest.

A run ID is a sortable UTC timestamp plus a random suffix (`20261129T154812Z-7f3a`); a resumed run
gets a NEW ID, so no file is ever appended to by two runs.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

RUN_ID_RE = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{4,}$")
DEFAULT_RUNS_DIR = "runs"


def new_run_id(now: float | None = None) -> str:
    t = datetime.fromtimestamp(time.time() if now is None else now, tz=timezone.utc)
    return f"{t:%Y%m%dT%H%M%SZ}-{secrets.token_hex(2)}"


def is_run_id(s: str) -> bool:
    return bool(RUN_ID_RE.match(s))


def runs_root(runs_dir: str | os.PathLike | None = None) -> Path:
    return Path(runs_dir or os.environ.get("DFLASH_RUNS_DIR") or DEFAULT_RUNS_DIR)


def run_dir(run_id: str, runs_dir: str | os.PathLike | None = None) -> Path:
    if not is_run_id(run_id):
        raise ValueError(f"not a run ID: {run_id!r} (expected like 20261129T154812Z-7f3a)")
    return runs_root(runs_dir) / run_id


def make_run_dir(run_id: str, runs_dir=None) -> Path:
    d = run_dir(run_id, runs_dir)
    (d / "logs").mkdir(parents=True, exist_ok=True)
    (d / "checkpoints").mkdir(exist_ok=True)
    return d


def point_latest(run_id: str, runs_dir=None, *, local: bool = False) -> bool:
    """Point `runs/latest` at this run, atomically, only forward (never to an older run ID); `local` (a
    brokerless run) never moves it off a broker's run. Returns whether it moved."""
    root = runs_root(runs_dir)
    link = root / "latest"
    current = os.readlink(link) if link.is_symlink() else None
    if current is not None and is_run_id(current) and (root / current).is_dir():
        if current.split("-")[0] > run_id.split("-")[0]:  # started in a later second: newer (same second: ours)
            return False
        if local and is_broker_run(root / current):
            return False
    tmp = root / f".latest-{os.getpid()}-{secrets.token_hex(2)}"
    os.symlink(run_id, tmp)
    os.replace(tmp, link)
    return True


def latest_run(runs_dir=None) -> str | None:
    """The run ID `runs/latest` names, or None (no link, or it names no run folder)."""
    root = runs_root(runs_dir)
    link = root / "latest"
    current = os.readlink(link) if link.is_symlink() else None
    return current if current is not None and is_run_id(current) and (root / current).is_dir() else None


def give_back_latest(run_id: str, previous: str | None, runs_dir=None) -> bool:
    """Point `runs/latest` back at `previous` if it still names `run_id`, a run that turned out empty
    and would hide the one an operator means. Returns whether it moved."""
    root = runs_root(runs_dir)
    if previous is None or latest_run(runs_dir) != run_id or not (root / previous).is_dir():
        return False
    tmp = root / f".latest-{os.getpid()}-{secrets.token_hex(2)}"
    os.symlink(previous, tmp)
    os.replace(tmp, root / "latest")
    return True


def is_broker_run(folder: Path) -> bool:
    """Whether a run folder is a broker's (its run.json has the broker's section)."""
    try:
        return "broker" in json.loads((folder / "run.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def resolve_run(ref: str | None, runs_dir=None) -> Path:
    """A run folder from an ID, a path, 'latest' or None (= latest). Raises FileNotFoundError."""
    root = runs_root(runs_dir)
    if ref in (None, "", "latest"):
        p = root / "latest"
        if not p.exists():
            raise FileNotFoundError(f"no runs/latest under {root.resolve()}: no run has started here")
        return p.resolve()
    p = Path(ref)
    if p.is_dir():
        return p.resolve()
    if is_run_id(ref) and (root / ref).is_dir():
        return (root / ref).resolve()
    raise FileNotFoundError(f"no run {ref!r} (looked for a folder and for {root / ref})")


def resumed_by(run_dir: Path) -> list[dict]:
    """The runs beside `run_dir` that resumed it, oldest first, as {run_id, outcome, started_at, run_dir}."""
    run_dir = Path(run_dir)
    me = run_dir.name
    out = []
    for p in sorted(run_dir.parent.iterdir()) if run_dir.parent.is_dir() else []:
        if not (is_run_id(p.name) and p.name > me and p.is_dir()):
            continue
        try:
            info = json.loads((p / "run.json").read_text())
        except (OSError, ValueError):
            continue  # no run.json yet (a broker that died while starting): it resumed nothing
        if isinstance(info, dict) and info.get("parent_run") == me:
            out.append({"run_id": p.name, "outcome": info.get("outcome"), "started_at": info.get("started_at"),
                        "run_dir": str(p)})
    return out


def newest_descendant(run_dir: Path) -> dict | None:
    """The run at the end of `run_dir`'s resume chain, as resumed_by gives it; None if none."""
    last = None
    while kids := resumed_by(run_dir):
        last = kids[-1]
        run_dir = Path(last["run_dir"])
    return last


class StorageError(RuntimeError):
    """A run folder's file could not be written: the owner stops with this reason, not a traceback."""


def write_json_atomic(path: Path, obj, *, in_place_if_full: bool = False) -> None:
    """`obj` as JSON at `path` via a temp file and rename; `in_place_if_full` rewrites in place on a full disk
    so a run's outcome still gets written."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=str)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if not (in_place_if_full and e.errno in (errno.ENOSPC, errno.EDQUOT) and path.exists()):
            raise
        with open(path, "r+") as f:
            f.truncate(0)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def iso_utc(t: float) -> str:
    """`2026-11-29T15:48:12.345Z`: the time format of run.json and the logs."""
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def write_run_json(run_dir: Path, run_id: str, *, config: dict, parent_run: str | None = None,
                   resumed_from=None, **role_fields) -> dict:
    """The first run.json of a new run (ID, parent, start, config, versions, the role's fields); returns it."""
    info = {"run_id": run_id, "parent_run": parent_run, "resumed_from": resumed_from,
            "started_at": iso_utc(time.time()), "config": config, "versions": versions(), **role_fields}
    write_json_atomic(run_dir / "run.json", info)
    return info


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("dflash-pipeline", "torch", "transformers", "pyzmq", "msgpack", "structlog"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def hostname() -> str:
    return socket.gethostname()
