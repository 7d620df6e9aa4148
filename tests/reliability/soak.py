"""The long soak (issue 19 "Must show"): a real CPU pipeline (broker, 2 producers, 2 elastic
consumers on the tiny target, tests/reliability/chaos_pipeline.py) run for --minutes while
a random role, the broker included, is SIGKILLed every --kill-every seconds (a random
interval; only once the run made progress since the last kill), and an operator restarts
what died as docs/RELIABILITY.md 7 says (chaos_operator.py): a producer started again, a
consumer started again once the broker declared it lost, after a broker death everything
stopped and started again with `dflash-broker --resume` (consumers take the checkpoint the
broker names). A process that exits non-zero without a kill is counted and restarted the
same way (a consumer refused `job_lost`, or failing again and again, means a full resume).

At --minutes the operator stops the run on purpose (SIGTERM the broker: it drains, the
consumers checkpoint and commit). With --finish it then resumes once more without kills
and lets the run end. The audit reads the chain of ledgers and the final checkpoint's
record (chaos_audit.py): no committed sample missing from the final weights, none trained
or committed twice; after a completed run, every (epoch, sample) trained exactly once. The
final checkpoint is exported and loaded back (dflash-export, load_exported).

    python -m tests.reliability.soak --minutes 30            # the long form, by hand
    python -m tests.reliability.soak --minutes 3 --finish    # a short one

The broker's liveness timeout is its own default (10 s, --timeout-s), not the chaos test's
3 s, and a (re)started broker may take --start-s to answer: on a loaded host a process can
stall for seconds and an import of torch takes minutes; neither is what the soak tests.

The last line on stdout is a JSON summary (`ok` and `not_ok`, its reasons; lost, duplicated,
kills and restarts by role, exits without a kill and their reasons, the kill intervals seen,
samples trained, late progress, checkpoint_load_ok, the machine and the command, ...); the
exit status is 0 only when `ok`. Besides the audit, `ok` wants training late in the chaos
phase: samples committed in the last max(2 min, 10%) of --minutes or during the stop
(`verdict`, docs/RELIABILITY.md 11).
Everything the processes wrote stays under --out for a post-mortem.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path


from tests.reliability.chaos_audit import audit
from tests.reliability.chaos_operator import ROLES, Operator, progress
from tests.reliability.chaos_pipeline import Pipeline

BUNDLED_ROWS = 400  # chats bundled with the producer (dflash/producers/sample_data)
# Epochs per soak minute: generous, so that the chaos phase never runs out of data on a fast
# machine; the run is stopped on purpose at --minutes, not by the end of the data.
EPOCHS_PER_MINUTE = 6
# A consumer that fails this often in one generation without a kill is not coming back by
# rejoining: the operator resumes the whole run instead.
MAX_REJOINS = 3
STOP_WAIT_S = 120  # at the deadline, how long the stop waits for a restarted run to train
# `ok` wants samples committed this late: in the last max(2 min, 10%) of --minutes, or during
# the stop. (A wider window passed a soak whose consumers were all refused for its last minutes.)
LATE_MIN_S, LATE_FRACTION = 120.0, 0.10


class SoakOperator(Operator):
    """Kills on a clock until `chaos_until`, then stops the run on purpose; exits without a
    kill are an operator's problem to fix (restart), recorded for the summary."""

    def __init__(self, pipe: Pipeline, rng: random.Random, chaos_until: float, deadline: float,
                 every: tuple[float, float]):
        super().__init__(pipe, rng, [], deadline)
        self.chaos_until, self.every = chaos_until, every
        self.last_kill = time.monotonic()
        self.kill_times: list[float] = []  # monotonic time of each kill, for the intervals
        self.role: str | None = None  # the next victim's role, drawn once per kill
        self.stopping = True  # False while --finish lets the run end by itself
        self.unexpected: list[dict] = []  # exits without a kill
        self.failed: Counter = Counter()  # per generation: role -> exits without a kill

    def next_kill(self) -> str | None:
        if time.monotonic() >= self.chaos_until:
            return None
        if self.role is None:
            self.role = self.rng.choice(ROLES)
        return self.role

    def kill_time(self, now: float) -> float:
        # Some training after a restart, and the interval since the last kill.
        return max(now + self.rng.uniform(0.0, 3.0), self.last_kill + self.rng.uniform(*self.every))

    def killed_one(self, role: str) -> None:
        self.role, self.last_kill = None, time.monotonic()
        self.kill_times.append(self.last_kill)

    def stop_now(self) -> bool:
        # At the deadline, once this generation trains (a stop during a restart would only
        # test the start): the stop's drain and last commit are part of what is soaked.
        now = time.monotonic()
        return self.stopping and now >= self.chaos_until and (now >= self.chaos_until + STOP_WAIT_S
                                                             or progress(self.pipe) > 0)

    def _note(self, gen: int, name: str, code: int) -> None:
        tail = self.pipe.tail(name, 600).strip().splitlines()
        self.unexpected.append({"gen": gen, "name": name, "code": code, "last": tail[-1][-300:] if tail else ""})
        print(f"gen {gen}: {name} exited {code} without a kill: {self.unexpected[-1]['last']}", flush=True)

    def unexpected_exits(self, gen: int, bad: dict[str, int]) -> str | None:
        pipe = self.pipe
        for name, code in bad.items():
            self._note(gen, name, code)
            text = pipe.tail(name, 4000)
            pipe.procs.pop(name)
            role = "producer" if name[0] == "p" else "consumer"
            self.failed[role] += 1
            fresh = f"{name.split('-')[0]}-g{gen}x{self.failed[role]}"
            if role == "producer":
                pipe.start_producer(fresh)
                self.restarted["producer"] += 1
            elif "job_lost" in text or self.failed["consumer"] > MAX_REJOINS:
                # The live run cannot take consumers back (RELIABILITY.md 7): resume it.
                codes = pipe.stop_rest()
                return f"{name} exited {code}; resumed; exits {codes}"
            else:
                self.rejoin[name] = fresh
        return None

    def broker_ended(self, gen: int, code: int) -> str:
        pipe = self.pipe
        outcome = (pipe.run_json(pipe.chain[-1]) or {}).get("outcome")
        pipe.drop_late_joiners()
        pipe.wait_exit(list(pipe.procs), 60)
        if code == 0 and outcome == "completed":
            for name, c in pipe.exited().items():
                if c != 0 and name != "broker":
                    self._note(gen, name, c)
            pipe.stop_rest()
            return "completed"
        self._note(gen, "broker", code)
        codes = pipe.stop_rest()
        if code == 3:  # nothing_to_train: a resume would find nothing either
            return f"final: broker exited 3 ({outcome})"
        return f"broker exited {code} ({outcome}); exits {codes}"

    def _generation(self, gen: int) -> str:
        self.failed.clear()
        return super()._generation(gen)


def _load_check(checkpoint: Path, out: Path, target: str) -> tuple[bool, str | None]:
    """Export the final checkpoint and load the export back, as a user would."""
    import torch

    from dflash.consumers.export.export import export_checkpoint, load_exported

    try:
        drafter = load_exported(export_checkpoint(checkpoint, out / "export", target=target, overwrite=True))
        bad = [k for k, v in drafter.model.state_dict().items() if not torch.isfinite(v).all()]
        return (not bad, f"non-finite: {bad[:4]}" if bad else None)
    except Exception as e:  # reported in the summary, not a traceback that hides it
        return False, f"{type(e).__name__}: {e}"


def late_window_s(minutes: float) -> float:
    return max(LATE_MIN_S, LATE_FRACTION * minutes * 60)


def late_progress(commits: list[tuple[float, int]], chaos_end: float, end: float, window_s: float) -> dict:
    """Samples committed from `window_s` before the deadline (or before `end`, when the chaos
    run ended earlier) to `end`, the chaos run's end (its stop); commits are (time, samples)."""
    lo = min(chaos_end, end) - window_s
    times = [ts for ts, n in commits if n > 0 and ts <= end]
    return {"late_window_s": round(window_s), "late_committed": sum(n for ts, n in commits if n > 0 and lo <= ts <= end),
            "last_commit_age_s": round(end - max(times)) if times else None}


def verdict(*, error: str | None, ended: str | None, lost: int, duplicated: int, unexpected: int, inherited_ok: bool,
            record_complete: bool, load_ok: bool, late_committed: int) -> list[str]:
    """Why the soak is not ok; empty when it is."""
    why = [] if error is None else [f"error: {error}"[:300]]
    if ended is None or ended.startswith("final:"):
        why.append(f"ended: {ended}")
    why += [w for bad, w in ((lost, f"lost {lost}"), (duplicated, f"duplicated {duplicated}"),
                             (unexpected, f"unexpected samples {unexpected}"),
                             (not inherited_ok, "a resumed run did not inherit exactly its parents' commits"),
                             (not record_complete, "final record incomplete"), (not load_ok, "checkpoint did not load"),
                             (late_committed <= 0, "no samples committed late in the chaos phase")) if bad]
    return why


def exit_reasons(exits: list[dict], top: int = 8) -> list[dict]:
    """Exits without a kill grouped by role, exit code and last output line, most frequent first."""
    role = {"b": "broker", "p": "producer", "c": "consumer"}
    groups = Counter((role.get(e["name"][:1], e["name"]), e["code"], e["last"][:200]) for e in exits)
    return [{"role": r, "code": c, "last": last, "n": n} for (r, c, last), n in groups.most_common(top)]


def _commits(runs: Path, chain: list[str]) -> list[tuple[float, int]]:
    from tests.reliability.chaos_audit import _rows

    return [row for run in chain if (runs / run / "ledger.sqlite").is_file()
            for row in _rows(runs / run, "SELECT ts, samples FROM commits")]


def _intervals(times: list[float]) -> dict | None:
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    if not gaps:
        return None
    return {"min": round(gaps[0], 1), "median": round(gaps[len(gaps) // 2], 1), "max": round(gaps[-1], 1)}


def soak(out: Path, *, minutes: float, seed: int, rows: int, epochs: int, every: tuple[float, float],
         finish: bool, finish_minutes: float, timeout_s: float = 10.0, start_s: float = 300.0) -> dict:
    rng = random.Random(seed)
    pipe = Pipeline(out, n_rows=rows, epochs=epochs, seed=seed % 1000, timeout_s=timeout_s, start_s=start_s)
    load_start = os.getloadavg()
    t0, t0_wall = time.monotonic(), time.time()  # ledger commits carry wall time
    chaos_until = t0 + minutes * 60
    chaos_end = end = t0_wall + minutes * 60
    # the stop's drain, a broker start at the deadline, the finish
    deadline = chaos_until + 300 + start_s + (finish_minutes * 60 if finish else 0)
    op = SoakOperator(pipe, rng, chaos_until, deadline, every)
    ended, error = None, None
    try:
        ended = op.run()
        end = time.time()  # the chaos run's end: the stop done (or an earlier completion)
        if ended == "stopped" and finish:
            op.stopping = False  # no kills (past chaos_until), no stop: let the run end
            ended = op.run(resume=pipe.chain[-1], gen=len(op.generations))
    except BaseException as e:  # KeyboardInterrupt included: what is on disk is still audited
        error = f"{type(e).__name__}: {e}"
        end = min(end, time.time())
        traceback.print_exc()
    finally:
        pipe.close()
    wall = time.monotonic() - t0

    a = audit(pipe.runs, pipe.chain, epochs, rows)
    committed = set(a.ledger)
    done = ended in ("completed", "nothing left to train")
    # A completed chain must hold every (epoch, sample); a stopped one every committed one
    # (what is not committed yet is made again by a resume: `inherited_ok`).
    lost = a.lost if done else committed - set(a.record)
    load_ok, load_error = (_load_check(a.final_checkpoint, out, pipe.target) if a.final_checkpoint
                           else (False, "no commit in the chain"))
    summary = {
        "lost": len(lost), "duplicated": len(a.duplicated), "unexpected_samples": len(a.unexpected),
        "kills": {r: op.killed[r] for r in ROLES}, "kill_interval_s": _intervals(op.kill_times),
        "restarts": {r: op.restarted[r] for r in ("producer", "consumer", "generation")},
        "exits_without_kill": len(op.unexpected), "exit_reasons": exit_reasons(op.unexpected),
        **late_progress(_commits(pipe.runs, pipe.chain), chaos_end, end, late_window_s(minutes)),
        "samples_trained": sum(a.record.values()), "committed": sum(a.ledger.values()), "expected": len(a.expected),
        "pending": len(a.expected - committed), "held_uncommitted": len(set(a.record) - committed),
        "inherited_ok": a.inherited_ok, "record_complete": a.record_complete,
        "checkpoint_load_ok": load_ok, "load_error": load_error,
        "ended": ended, "error": error, "runs": len(pipe.chain), "seed": seed, "minutes": minutes,
        "wall_s": round(wall), "rows": rows, "epochs": epochs, "timeout_s": timeout_s, "out": str(out),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_start": [round(x, 1) for x in load_start],
                    "load_end": [round(x, 1) for x in os.getloadavg()]},
        "command": " ".join(sys.argv),
        "final_checkpoint": str(a.final_checkpoint) if a.final_checkpoint else None,
    }
    summary["not_ok"] = verdict(error=error, ended=ended, lost=len(lost), duplicated=len(a.duplicated),
                                unexpected=len(a.unexpected), inherited_ok=a.inherited_ok,
                                record_complete=a.record_complete, load_ok=load_ok,
                                late_committed=summary["late_committed"])
    summary["ok"] = not summary["not_ok"]
    (out / "soak-summary.json").write_text(json.dumps({**summary, "generations": op.generations,
                                                       "exits": op.unexpected}, indent=1))
    return summary


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _every(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition("-")
    lo_s, hi_s = float(lo), float(hi or lo)
    if not 0 < lo_s <= hi_s:
        raise argparse.ArgumentTypeError(f"--kill-every {text!r}: want LOW-HIGH seconds, 0 < LOW <= HIGH")
    return lo_s, hi_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="chaos phase length (default 30)")
    ap.add_argument("--kill-every", type=_every, default=(20.0, 60.0), metavar="LOW-HIGH",
                    help="seconds between kills, drawn uniformly (default 20-60)")
    ap.add_argument("--seed", type=int, default=None, help="replays the kill plan's draws (default: random, printed)")
    ap.add_argument("--rows", type=int, default=BUNDLED_ROWS, help=f"bundled chats used, at most {BUNDLED_ROWS}")
    ap.add_argument("--epochs", type=int, default=None,
                    help=f"default: {EPOCHS_PER_MINUTE} per minute of soak (more data than the soak trains)")
    ap.add_argument("--finish", action="store_true", help="after the stop, resume once without kills to the end")
    ap.add_argument("--finish-minutes", type=float, default=30.0, help="time bound of --finish (default 30)")
    ap.add_argument("--timeout-s", type=float, default=10.0,
                    help="the broker's liveness --timeout-s (default 10, the broker's own default)")
    ap.add_argument("--start-s", type=float, default=300.0,
                    help="how long a (re)started broker may take to answer status (default 300)")
    ap.add_argument("--out", type=Path, default=None, help="working folder (default: a new one under /tmp, kept)")
    args = ap.parse_args(argv)
    if not 1 <= args.rows <= BUNDLED_ROWS:
        ap.error(f"--rows {args.rows}: 1 to {BUNDLED_ROWS} (the bundled chats)")
    if args.minutes <= 0:
        ap.error("--minutes must be > 0")
    if args.timeout_s <= 1.0 or args.start_s <= 0:
        ap.error("--timeout-s must be > 1 (twice the pipeline's 0.5 s heartbeat) and --start-s > 0")
    # SIGTERM stops the soak as Ctrl-C does: the processes are closed, what is on disk audited.
    signal.signal(signal.SIGTERM, _interrupt)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    epochs = args.epochs or max(2, math.ceil(args.minutes * EPOCHS_PER_MINUTE))
    out = args.out or Path(tempfile.mkdtemp(prefix="dflash-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"soak seed {seed} (--seed {seed} replays the draws), {args.minutes} min, kills every "
          f"{args.kill_every[0]:g}-{args.kill_every[1]:g} s, liveness timeout {args.timeout_s:g} s, {args.rows} samples x {epochs} epochs, in {out}",
          flush=True)
    summary = soak(out, minutes=args.minutes, seed=seed, rows=args.rows, epochs=epochs, every=args.kill_every,
                   finish=args.finish, finish_minutes=args.finish_minutes, timeout_s=args.timeout_s,
                   start_s=args.start_s)
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
