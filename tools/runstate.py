"""What a run's files say about it, for `dflash-status --run`: did it finish, stop or die,
when, and at which step. Never presents a run as live unless its broker answers with
that very run ID (docs/DESIGN.md incidents 3 and 5: a dead terminal read as a dead run, an
old run's lines read as the new run's).

Verdicts:
  LIVE          the broker answers status with this run ID
  FINISHED      run.json outcome `completed` (or a brokerless consumer run logged `train.end`)
  STOPPED       run.json outcome `interrupted` (SIGINT/SIGTERM; resumable)
  DIED          outcome `crashed`/`failed`/`storage_failed`, or no end recorded and nothing alive
  NOTHING_TRAINED  outcome `nothing_to_train`: end of stream without one sample trained (the
                reason says why: an empty dataset, every sample skipped)
  UNRESPONSIVE  no end recorded, the broker does not answer, its pid on this host exists
  RUNNING       a brokerless consumer run with no end recorded whose process is alive here
"""

from __future__ import annotations

import json
import os
import sqlite3
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from dflash.runtime.run import hostname, newest_descendant, resumed_by

from .runlogs import log_files

TAIL_BYTES = 4 << 20  # the end of each log file read for the last step and last sign of life
ERROR_NEEDLE = b'"level": "error"'
ENDED = {"completed": "FINISHED", "interrupted": "STOPPED", "crashed": "DIED", "failed": "DIED",
         "nothing_to_train": "NOTHING_TRAINED", "storage_failed": "DIED"}


def _age_s(iso: str | None) -> float | None:
    if not iso:
        return None
    try:
        t = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return None
    return round((datetime.now(timezone.utc) - t).total_seconds(), 1)


def read_run_json(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def log_facts(run_dir: Path) -> dict:
    """Last sign of life, last train.step, train.end and the pids that logged, from the
    end of each file; error lines counted over whole files. A multi-day run's logs are
    gigabytes: parsing them all would take minutes, reading tails takes milliseconds."""
    out = {"last_ts": None, "last_step": None, "last_step_at": None, "train_end": None, "pids": set(),
           "errors": 0}
    for path in log_files(run_dir):
        out["errors"] += count_errors(path)
        for ev in tail_events(path):
            ts = ev.get("ts")
            if isinstance(ts, str) and (out["last_ts"] is None or ts > out["last_ts"]):
                out["last_ts"] = ts
            if ev.get("host") == hostname() and isinstance(ev.get("pid"), int):
                out["pids"].add(ev["pid"])
            if ev.get("event") == "train.step" and isinstance(ev.get("step"), int):
                if out["last_step"] is None or ev["step"] >= out["last_step"]:
                    out["last_step"], out["last_step_at"] = ev["step"], ts
            elif ev.get("event") == "train.end":
                out["train_end"] = {"ts": ts, "reason": ev.get("reason"), "step": ev.get("step")}
    return out


def tail_events(path: Path, nbytes: int = TAIL_BYTES) -> list[dict]:
    """The parseable JSON lines in the last `nbytes` of a log file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(max(0, size - nbytes))
        data = f.read()
    if size > nbytes:
        data = data.split(b"\n", 1)[-1]  # the first line was cut by the seek
    out = []
    for line in data.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:  # a torn last line (a crash mid-write)
            continue
        if isinstance(ev, dict):
            out.append(ev)
    return out


def count_errors(path: Path, chunk_bytes: int = 1 << 22) -> int:
    """Error lines in a whole file, by a byte search (runtime/logs.py writes `"level": "error"`)."""
    n, carry = 0, b""
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            buf = carry + chunk
            n += buf.count(ERROR_NEEDLE)
            carry = buf[-(len(ERROR_NEEDLE) - 1):]  # a match split across chunks is found next time
    return n


def ledger_counts(run_dir: Path) -> dict | None:
    """Samples by state and the last commit, read-only; None without a readable ledger."""
    path = run_dir / "ledger.sqlite"
    if not path.exists():
        return None
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2)
        try:
            counts = dict(db.execute("SELECT state, COUNT(*) FROM samples GROUP BY state").fetchall())
            commit = db.execute("SELECT step, checkpoint FROM commits ORDER BY step DESC LIMIT 1").fetchone()
            n = db.execute("SELECT n_samples FROM epochs ORDER BY epoch DESC LIMIT 1").fetchone()
            has_inherited = db.execute("SELECT 1 FROM sqlite_master WHERE name='inherited'").fetchone()
            inherited = db.execute("SELECT COUNT(*) FROM inherited").fetchone()[0] if has_inherited else 0
        finally:
            db.close()
    except sqlite3.Error:
        return None
    return {"samples": counts, "last_commit": {"step": commit[0], "checkpoint": commit[1]} if commit else None,
            "n_samples": n[0] if n else None, "inherited": inherited}


def last_checkpoint(run_dir: Path) -> str | None:
    steps = [(int(p.name.split("-", 1)[1]), p) for p in (run_dir / "checkpoints").glob("step-*")
             if p.name.split("-", 1)[1].isdigit()]
    return str(max(steps)[1]) if steps else None


def pid_alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def describe(run_dir: Path, ask: Callable[[str], dict | None], broker: str | None) -> dict:
    """The verdict on a run and the facts behind it.

    `ask(endpoint)` returns the live status map at an endpoint or None; `broker` is the
    endpoint the user named with --broker (None if they did not)."""
    info, logs = read_run_json(run_dir), log_facts(run_dir)
    run_id = info.get("run_id") or run_dir.name
    br = info.get("broker") or {}
    out = {"run_id": run_id, "run_dir": str(run_dir), "parent_run": info.get("parent_run"),
           "started_at": info.get("started_at"), "ended_at": info.get("ended_at"), "outcome": info.get("outcome"),
           "error": info.get("error"), "signal": info.get("signal"), "last_seen_at": logs["last_ts"],
           "last_seen_ago_s": _age_s(logs["last_ts"]), "last_step": logs["last_step"],
           "last_step_at": logs["last_step_at"], "error_lines": logs["errors"], "ledger": ledger_counts(run_dir),
           "last_checkpoint": last_checkpoint(run_dir), "bad_batches": info.get("bad_batches") or {}, "notes": [],
           # the runs that continued this one (dflash-broker --resume): where its story goes on
           "resumed_by": [k["run_id"] for k in resumed_by(run_dir)], "chain_end": None}
    if out["resumed_by"]:
        end = newest_descendant(run_dir)
        out["chain_end"] = {"run_id": end["run_id"], "outcome": end["outcome"]}
    cfg, led = info.get("config") or {}, out["ledger"]
    epochs = cfg.get("epochs")
    # the ledger's epochs table has a row once a lease was granted; a resumed run knows its dataset before
    dataset_n = ((info.get("facts") or {}).get("dataset") or {}).get("n_samples")
    n = (led.get("n_samples") if led else None) or dataset_n or cfg.get("num_samples")
    out["samples_total"] = n * epochs if isinstance(n, int) and isinstance(epochs, int) else None
    live = _ask_brokers(out, ask, broker, (br.get("endpoints") or {}).get("control"))
    if live is not None:
        out.update(verdict="LIVE", live=True, status=live)
        return out
    out["live"] = False
    out.update(_verdict(info, logs, br))
    return out


def _ask_brokers(out: dict, ask, named: str | None, recorded: str | None) -> dict | None:
    """The live map if a broker answers with this run; notes on brokers serving another."""
    for endpoint in dict.fromkeys(e for e in (named, recorded) if e):
        st = ask(endpoint)
        if st is None:
            out["notes"].append(f"the broker at {endpoint} does not answer")
        elif st.get("run_id") == out["run_id"]:
            return st
        else:
            out["notes"].append(f"the broker at {endpoint} is live but serves another run, {st.get('run_id')} "
                                f"(started {st.get('broker', {}).get('started_at')}), not this one")
    return None


def _skipped(info: dict) -> str:
    """' (N skipped)' when a completed run's samples record skipped ones, else ''."""
    n = (info.get("samples") or {}).get("skipped") if isinstance(info.get("samples"), dict) else None
    return f" ({n} skipped by their producers)" if n else ""


def _completed(info: dict) -> str:
    """Why a completed run ended: every sample trained, less those set aside as poison (by
    fault, from run.json's `bad_batches`) and those its producers skipped."""
    samples = info.get("samples") if isinstance(info.get("samples"), dict) else {}
    aside = samples.get("quarantined") or 0
    if not aside:
        return "end of stream: every sample trained" + _skipped(info)
    faults = ((info.get("bad_batches") or {}).get("quarantined") or {}) if isinstance(info.get("bad_batches"),
                                                                                        dict) else {}
    by = ", ".join(f"{n.get('set_aside', 0)} {fault}" for fault, n in sorted(faults.items()) if n.get("set_aside"))
    return (f"end of stream: every sample trained but {aside} set aside as poison ({by or 'quarantined'}: "
            "consumers failed on their batches)" + _skipped(info))


def _verdict(info: dict, logs: dict, br: dict) -> dict:
    outcome = info.get("outcome")
    if outcome in ENDED:
        why = {"completed": _completed(info),
               "interrupted": f"stopped by {info.get('signal')}",
               "crashed": f"the broker crashed: {info.get('error')}", "failed": f"failed to start: {info.get('error')}",
               "nothing_to_train": f"end of stream with nothing trained: {info.get('reason')}",
               "storage_failed": f"the broker stopped: the disk refused a write ({info.get('error')}); free space "
                                 "under the runs folder, then dflash-broker --resume"}
        return {"verdict": ENDED[outcome], "at": info.get("ended_at"), "why": why[outcome]}
    if br:  # a broker run with no end recorded
        if br.get("host") == hostname() and pid_alive(br.get("pid")):
            return {"verdict": "UNRESPONSIVE", "at": logs["last_ts"], "alive_pids": [br.get("pid")],
                    "why": f"no end recorded; broker pid {br.get('pid')} exists on this host but does not answer"}
        return {"verdict": "DIED", "at": logs["last_ts"], "why": "no end recorded and no live broker "
                "(killed, or its host went down); 'at' is its last log line"}
    if logs["train_end"]:  # a brokerless consumer run (dflash-consume --synthetic-batches)
        end = logs["train_end"]
        return {"verdict": "FINISHED", "at": end["ts"], "why": f"train.end: {end['reason']} at step {end['step']}"}
    alive = sorted(p for p in logs["pids"] | {info.get("pid")} if pid_alive(p))
    if alive:
        return {"verdict": "RUNNING", "at": logs["last_ts"], "alive_pids": alive,
                "why": f"no broker; process {', '.join(map(str, alive))} alive on this host"}
    return {"verdict": "DIED", "at": logs["last_ts"], "why": "no end recorded and no process alive; "
            "'at' is its last log line"}


def _samples_line(led: dict, total: int | None) -> str:
    """The ledger's figures as the live view gives them (broker/status.py trained_figures):
    over the resume chain, inherited samples counted as trained and committed."""
    from .status_view import inherited

    s, n = led["samples"], led.get("inherited", 0)
    trained, committed = s.get("trained", 0) + s.get("committed", 0) + n, s.get("committed", 0) + n
    done = trained + s.get("skipped", 0) + s.get("quarantined", 0)
    pct = f" ({100 * done / total:.1f}%)" if total else ""
    commit = led.get("last_commit")
    return (f"  samples     trained {trained}  committed {committed}{inherited(n)}  skipped {s.get('skipped', 0)}  "
            f"of {total or '?'}{pct}{'  last commit step ' + str(commit['step']) if commit else ''}")


def render(d: dict) -> str:
    """The plain-words view of a run that is not live."""
    from .status_view import bad_batch_lines, clock, dur

    when = clock(d.get("at"), "%Y-%m-%d %H:%M:%SZ")
    ago = _age_s(d.get("at"))
    lines = [f"run {d['run_id']}  {d['verdict']} {when} ({dur(ago)} ago)  NOT LIVE: {d['why']}"]
    lines.append(f"  started     {clock(d.get('started_at'), '%Y-%m-%d %H:%M:%SZ')}"
                 f"{'  parent ' + d['parent_run'] if d.get('parent_run') else ''}")
    lines.append(f"  last seen   {clock(d.get('last_seen_at'), '%Y-%m-%d %H:%M:%SZ')} (last log line, "
                 f"{dur(d.get('last_seen_ago_s'))} ago)")
    step = d.get("last_step")
    lines.append(f"  last step   {step if step is not None else '-'}"
                 f"{' at ' + clock(d.get('last_step_at')) if step is not None else ''}"
                 f"  last checkpoint {d.get('last_checkpoint') or '-'}")
    led = d.get("ledger")
    if led:
        lines.append(_samples_line(led, d.get("samples_total")))
    lines += [f"  {x}" for x in bad_batch_lines(d.get("bad_batches") or {})]
    if d.get("error_lines"):
        lines.append(f"  errors      {d['error_lines']} error lines in this run's logs "
                     f"(dflash-logs --run {d['run_id']} --level error)")
    if d.get("resumed_by"):  # its continuation has what it committed: point there, never back here
        end = d["chain_end"]
        lines.append(f"  resumed by  {', '.join(d['resumed_by'])}"
                     + (f" (chain continued up to {end['run_id']})" if end["run_id"] != d["resumed_by"][-1] else "")
                     + f"; that run: dflash-status --run {end['run_id']}")
    elif d["verdict"] in ("STOPPED", "DIED"):
        lines.append(f"  resume      dflash-broker --resume {d['run_id']}")
    lines += [f"  note        {n}" for n in d.get("notes", [])]
    return "\n".join(lines)
