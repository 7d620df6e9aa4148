"""`dflash-broker --resume RUN`: what a new run takes over from the run it continues.

A resumed run gets a NEW run ID, folder and ledger and writes nothing of the parent's. It takes
the parent's seed, epochs and facts, every committed (epoch, sample) (never leased again; the rest
is made again), and `resumed_from`, the chain's newest commit, which consumers must load. The
parent's ledger is read from a copy. A run resumed already is refused unless `again`.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from dflash.runtime.run import hostname, newest_descendant, resolve_run, resumed_by


class ResumeError(ValueError):
    """The run cannot be resumed as asked; the message says why in one line."""


@dataclass
class Parent:
    run_id: str
    run_dir: Path
    seed: int
    epochs: int
    facts: dict
    n_samples: int | None
    committed: dict[int, bytearray] = field(repr=False)  # epoch -> bitmap, 1 = committed
    rows: list[tuple[int, int, str, int | None]] = field(repr=False)  # (epoch, sample, run, step)
    resumed_from: dict | None = None  # {run, step, checkpoint} of the chain's newest commit

    @property
    def n_committed(self) -> int:
        return len(self.rows)

    def summary(self) -> dict:
        """For run.json and the broker.resume log line."""
        return {"run": self.run_id, "run_dir": str(self.run_dir), "committed_samples": self.n_committed,
                "checkpoint": self.resumed_from}


def load(ref: str, runs_dir: str | os.PathLike | None = None, *, again: bool = False) -> Parent:
    """Read the run `ref` (a run ID, a run folder, or 'latest'); raises ResumeError."""
    try:
        run_dir = resolve_run(ref, runs_dir)
    except FileNotFoundError as e:
        raise ResumeError(str(e)) from None
    info = _run_json(run_dir)
    _refuse_if_running(info)
    if not again:
        _refuse_if_resumed(run_dir, info["run_id"])
    ledger = run_dir / "ledger.sqlite"
    if not ledger.exists():
        raise ResumeError(f"{run_dir} has no ledger.sqlite: nothing records what it trained")
    with tempfile.TemporaryDirectory(prefix="dflash-resume-") as tmp:
        db = sqlite3.connect(_copy_db(ledger, Path(tmp)))
        try:
            return _read(db, run_dir, info)
        except sqlite3.DatabaseError as e:
            raise ResumeError(f"cannot read {ledger}: {e}") from None
        finally:
            db.close()


def _run_json(run_dir: Path) -> dict:
    try:
        info = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError) as e:
        raise ResumeError(f"cannot read {run_dir / 'run.json'}: {e}") from None
    if not isinstance(info.get("run_id"), str) or not isinstance(info.get("config"), dict):
        raise ResumeError(f"{run_dir / 'run.json'} has no run_id/config: not a broker's run folder")
    return info


def _refuse_if_running(info: dict) -> None:
    """Two brokers serving one run's continuation would hand out the same samples twice."""
    broker = info.get("broker") or {}
    pid = broker.get("pid")
    if info.get("outcome") != "running" or broker.get("host") != hostname() or not isinstance(pid, int):
        return  # ended, or on another host: we cannot see it; the operator decides
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return  # crashed (SIGKILL, OOM): exactly the case resume is for
    except PermissionError:
        pass  # alive, another user's
    if _is_zombie(pid):
        return
    raise ResumeError(f"run {info['run_id']} is still being served by broker pid {pid} on this host; "
                      "stop it (SIGTERM) before resuming")


def _refuse_if_resumed(run_dir: Path, run_id: str) -> None:
    """Resuming a run again would train again, into a second drafter, what its continuation trained."""
    kids = resumed_by(run_dir)
    if not kids:
        return
    child, end = kids[-1], newest_descendant(run_dir)
    by = f"run {child['run_id']} ({_ended(child['outcome'])})"
    if end["run_id"] != child["run_id"]:
        by += f", itself continued up to run {end['run_id']} ({_ended(end['outcome'])})"
    if end["outcome"] == "completed":
        then = (f"that chain trained every sample; to train more epochs, dflash-broker --resume {end['run_id']} "
                "--epochs N")
    else:
        then = f"continue the chain with dflash-broker --resume {end['run_id']}"
    raise ResumeError(f"run {run_id} was resumed already by {by}: resuming it again would train again, into a "
                      f"second drafter, what that run trained since {run_id}'s last commit. To go on, {then}; to "
                      f"branch off {run_id} anyway, add --force-resume")


def _ended(outcome: str | None) -> str:
    return "no end recorded: live, or died" if outcome in (None, "running") else outcome


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _copy_db(src: Path, tmp: Path) -> Path:
    """Copy the database and its WAL, not the -shm index (SQLite rebuilds it)."""
    dst = tmp / src.name
    shutil.copyfile(src, dst)
    wal = src.with_name(src.name + "-wal")
    if wal.exists():
        shutil.copyfile(wal, dst.with_name(dst.name + "-wal"))
    return dst


def _read(db: sqlite3.Connection, run_dir: Path, info: dict) -> Parent:
    meta = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM meta")}
    run_id, cfg = info["run_id"], info["config"]
    if meta.get("run_id") not in (None, run_id):
        raise ResumeError(f"{run_dir}: ledger belongs to run {meta['run_id']}, run.json to {run_id}")
    if info.get("parent_run") and meta.get("parent_run") != info["parent_run"]:
        raise ResumeError(f"{run_dir}: run.json names parent {info['parent_run']} but the ledger does not")
    facts = info.get("facts") or meta.get("facts") or {}
    n = (facts.get("dataset") or {}).get("n_samples", cfg.get("num_samples"))
    rows = _committed_rows(db, run_id)
    committed: dict[int, bytearray] = {}
    for epoch, sample, _, _ in rows:
        if n is None or not 0 <= sample < n:
            raise ResumeError(f"{run_dir}: committed sample {sample} lies outside the dataset (n={n})")
        committed.setdefault(epoch, bytearray(n))[sample] = 1
    return Parent(run_id, run_dir, int(cfg["seed"]), int(cfg["epochs"]), facts, n, committed, rows,
                  _newest_commit(db, run_id, meta.get("resumed_from")))


def _committed_rows(db: sqlite3.Connection, run_id: str) -> list[tuple[int, int, str, int | None]]:
    own = db.execute("SELECT epoch, sample, ?, step FROM samples WHERE state='committed'", (run_id,)).fetchall()
    has_inherited = db.execute("SELECT 1 FROM sqlite_master WHERE name='inherited'").fetchone()
    older = db.execute("SELECT epoch, sample, run, step FROM inherited").fetchall() if has_inherited else []
    both = {(e, s) for e, s, _, _ in own} & {(e, s) for e, s, _, _ in older}
    if both:
        raise ResumeError(f"run {run_id} committed {len(both)} samples its parents had committed already "
                          f"(e.g. epoch/sample {sorted(both)[0]}): its ledger is inconsistent")
    return older + own


def _newest_commit(db: sqlite3.Connection, run_id: str, inherited: dict | None) -> dict | None:
    row = db.execute("SELECT step, checkpoint FROM commits ORDER BY ts DESC, rowid DESC LIMIT 1").fetchone()
    if row is None:
        return inherited  # the parent committed nothing itself: the chain's last commit stands
    return {"run": run_id, "step": row[0], "checkpoint": row[1]}


def check_config(parent: Parent, seed: int | None, epochs: int | None, num_samples: int | None) -> None:
    """Options given explicitly on a resume must agree with the parent. Raises ResumeError."""
    if seed is not None and seed != parent.seed:
        raise ResumeError(f"--seed {seed} differs from run {parent.run_id}'s seed {parent.seed}: a resume "
                          "keeps the sample order (leave --seed out)")
    if epochs is not None and epochs < parent.epochs:
        raise ResumeError(f"--epochs {epochs} is below run {parent.run_id}'s {parent.epochs}: "
                          "a resume may add epochs, never drop them")
    if num_samples is not None and parent.n_samples is not None and num_samples != parent.n_samples:
        raise ResumeError(f"--num-samples {num_samples} differs from run {parent.run_id}'s dataset "
                          f"({parent.n_samples} samples)")


def left_to_do(parent: Parent, epochs: int) -> int | None:
    """Samples the resumed run has to make (None while the dataset size is unknown)."""
    if parent.n_samples is None:
        return None
    return parent.n_samples * epochs - parent.n_committed


def inherit(ledger, parent: Parent) -> int:
    """Write the parent's committed samples and the parent link into the new ledger."""
    return ledger.inherit(parent.rows, parent_run=parent.run_id, resumed_from=parent.resumed_from)


def effective_config(cfg, parent: Parent, explicit: set[str]):
    """`cfg` with the parent's seed, epochs and dataset size; options in `explicit` must agree with it.
    Raises ResumeError, also when nothing is left to train."""
    check_config(parent, *(getattr(cfg, k) if k in explicit else None for k in ("seed", "epochs", "num_samples")))
    epochs = cfg.epochs if "epochs" in explicit else parent.epochs
    n = parent.n_samples if parent.n_samples is not None else cfg.num_samples
    if left_to_do(parent, epochs) == 0:
        raise ResumeError(f"run {parent.run_id} committed every sample of its {epochs} epoch(s): nothing is "
                          "left to train (raise --epochs to train more)")
    return replace(cfg, seed=parent.seed, epochs=epochs, num_samples=n)
