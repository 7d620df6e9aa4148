"""A series of chaos runs (issue 19 "Must show": 20 consecutive random-seed runs pass): draws
--runs seeds (or takes --seeds) and runs test_chaos.py's short form once per seed, each in a
process of its own: the same plan drawn from the seed, the same pipeline, operator and audit
(imported from test_chaos.py, chaos_operator.py, chaos_audit.py), and the same checks. Per
seed it records whether the run passed and what the audit read from the ledgers and the
final checkpoint's record: lost, duplicated, unexpected, committed, trained into the final
weights, kills by role, runs in the chain, wall time, and the error of a failed run.

    python -m tests.reliability.chaos_series --runs 20
    python -m tests.reliability.chaos_series --seeds 525848415,12   # replay given seeds

The one difference from the test is the time bound (--deadline-s): the test's guards
against a hang on an idle CI machine; on a loaded host a run may simply be slower, and the
series records its wall time instead of failing it (a run past --deadline-s still fails).
The seeds are printed before the first run; every result is appended as a JSON line to
--record as it ends (a series cut short keeps what it did); the last stdout line is a JSON
summary. The exit status is 0 only when every run passed. Each run's working folder (its
processes' output, the runs' ledgers and checkpoints) stays under --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: children import tests.* from it

RUN_TIMEOUT_S = 3600  # one run's process, whatever its own deadline says


def run_one(seed: int, work: Path, deadline_s: float, start_s: float) -> dict:
    """test_chaos.py's body for `seed`, in this process; the result instead of asserts."""
    import tests.reliability.test_chaos as tc
    from tests.reliability.chaos_audit import audit
    from tests.reliability.chaos_operator import Operator
    from tests.reliability.chaos_pipeline import Pipeline

    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    plan = tc._plan(rng, tc.KILLS)
    res: dict = {"seed": seed, "plan": plan, "kills_planned": tc.KILLS, "rows": tc.N_ROWS, "epochs": tc.EPOCHS}
    pipe = Pipeline(work, n_rows=tc.N_ROWS, epochs=tc.EPOCHS, seed=seed % 1000, start_s=start_s)
    t0 = time.monotonic()
    op = Operator(pipe, rng, plan, t0 + deadline_s)
    error = None
    try:
        op.run()
    except (Exception, KeyboardInterrupt) as e:  # the test would fail here: recorded, audited as far as it got
        error = f"{type(e).__name__}: {e}"[:1500]
        traceback.print_exc()
    finally:
        pipe.close()
    res["wall_s"] = round(time.monotonic() - t0)
    res["kills"] = dict(op.killed)
    res["runs_in_chain"] = len(pipe.chain)
    res["generations"] = op.generations
    try:
        a = audit(pipe.runs, pipe.chain, tc.EPOCHS, tc.N_ROWS)
        # A run cut short (an error) is not complete: what it committed must be in the final
        # weights (lost), the rest is still to make (pending), as in soak.py.
        lost = a.lost if error is None else set(a.ledger) - set(a.record)
        res.update(lost=len(lost), pending=len(a.expected - set(a.ledger)), duplicated=len(a.duplicated), unexpected=len(a.unexpected),
                   committed=sum(a.ledger.values()), trained=sum(a.record.values()), expected=len(a.expected),
                   inherited_ok=a.inherited_ok, record_complete=a.record_complete)
        checks = [(sum(op.killed.values()) == tc.KILLS and op.killed["broker"] >= 1, f"kills {dict(op.killed)}"),
                  (a.inherited_ok, "a resumed run did not inherit exactly its parents' commits"),
                  (not lost, f"lost {sorted(lost)[:10]}"), (not a.duplicated, f"duplicated {sorted(a.duplicated)[:10]}"),
                  (not a.unexpected, f"unexpected {sorted(a.unexpected)[:10]}"), (a.record_complete, "record incomplete")]
        failed = [why for ok, why in checks if not ok]
        if not failed and error is None:
            tc._loads(a.final_checkpoint)
            res["checkpoint_loads"] = True
    except Exception as e:
        failed = [f"audit or load: {type(e).__name__}: {e}"[:600]]
    if error is not None:
        failed.insert(0, error)
    res["passed"] = not failed
    if failed:
        res["error"] = " | ".join(failed)
    return res


CHILDREN: list[subprocess.Popen] = []  # ended on SIGTERM (each closes its pipeline)


def _spawn(seed: int, work: Path, deadline_s: float, start_s: float) -> dict:
    """One run in a child process (a fresh interpreter, as pytest would give it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}  # the short form
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    work.mkdir(parents=True, exist_ok=True)
    result = work / "result.json"
    t0 = time.monotonic()
    with open(work / "run.out", "w") as out:
        try:
            p = subprocess.Popen([sys.executable, "-m", "tests.reliability.chaos_series", "--one", str(seed), "--work", str(work),
                                  "--deadline-s", str(deadline_s), "--start-s", str(start_s)],
                                 stdout=out, stderr=subprocess.STDOUT, env=env)
            CHILDREN.append(p)
            try:
                p.wait(RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.terminate()
                p.wait(60)
                raise
            if result.is_file():
                return json.loads(result.read_text())
            why = f"exit {p.returncode}, no result"
        except subprocess.TimeoutExpired:
            why = f"over {RUN_TIMEOUT_S} s"
    return {"seed": seed, "passed": False, "lost": None, "duplicated": None, "wall_s": round(time.monotonic() - t0),
            "error": f"the run's process failed ({why}): see {work / 'run.out'}"}


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def _line(i: int, n: int, r: dict) -> str:
    return (f"[{i}/{n}] seed {r['seed']}: {'PASS' if r['passed'] else 'FAIL'} lost {r.get('lost')} "
            f"duplicated {r.get('duplicated')} committed {r.get('committed')}/{r.get('expected')} "
            f"trained {r.get('trained')} kills {r.get('kills')} runs {r.get('runs_in_chain')} {r['wall_s']} s"
            + ("" if r["passed"] else f"  {r.get('error')}"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=20, help="random seeds to draw (default 20)")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds to run instead of drawing")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    ap.add_argument("--deadline-s", type=float, default=1800.0, help="one run's time bound (default 1800)")
    ap.add_argument("--start-s", type=float, default=300.0,
                    help="how long a (re)started broker may take to answer status (default 300; the test: 60)")
    ap.add_argument("--record", type=Path, default=None, help="JSON lines, one per run (default: in --keep)")
    ap.add_argument("--keep", type=Path, default=None, help="working folders (default: a new one under /tmp)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: this seed, in --work
    ap.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.deadline_s <= 0:
        ap.error("--deadline-s must be > 0")
    # SIGTERM ends a run as Ctrl-C would: its pipeline is closed, what it did is recorded.
    signal.signal(signal.SIGTERM, _interrupt)
    if args.one is not None:
        res = run_one(args.one, args.work, args.deadline_s, args.start_s)
        (args.work / "result.json").write_text(json.dumps(res))
        return 0
    if args.seeds:
        try:
            seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        except ValueError:
            ap.error(f"--seeds {args.seeds!r}: want integers separated by commas")
    else:
        if args.runs < 1:
            ap.error("--runs must be >= 1")
        draw = random.SystemRandom()
        seeds = [draw.randrange(1 << 30) for _ in range(args.runs)]  # as test_chaos.py draws its own
    if args.jobs < 1:
        ap.error("--jobs must be >= 1")
    keep = args.keep or Path(tempfile.mkdtemp(prefix="dflash-chaos-series-"))
    keep.mkdir(parents=True, exist_ok=True)
    record = args.record or keep / "series.jsonl"
    print(f"chaos series: {len(seeds)} runs of test_chaos.py's short form, {args.jobs} at a time, seeds "
          f"{','.join(map(str, seeds))}; record {record}, folders in {keep}", flush=True)
    t0 = time.monotonic()
    results: list[dict] = []

    def one(i_seed):
        i, seed = i_seed
        res = _spawn(seed, keep / f"{i:02d}-{seed}", args.deadline_s, args.start_s)
        results.append(res)  # list.append is atomic: the pool's threads share it safely
        with open(record, "a") as f:
            f.write(json.dumps(res) + "\n")
        print(_line(len(results), len(seeds), res), flush=True)

    pool = ThreadPoolExecutor(args.jobs)
    try:
        list(pool.map(one, enumerate(seeds, 1)))
    except KeyboardInterrupt:
        print("series stopped: the runs under way end and are recorded, the rest are not started", flush=True)
        for p in CHILDREN:
            if p.poll() is None:
                p.terminate()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    failed = [r["seed"] for r in results if not r["passed"]]
    kills: dict = {}
    for r in results:
        for role, n in (r.get("kills") or {}).items():
            kills[role] = kills.get(role, 0) + n
    summary = {"runs": len(results), "passed": len(results) - len(failed), "failed_seeds": failed,
               "lost": sum(r.get("lost") or 0 for r in results),
               "duplicated": sum(r.get("duplicated") or 0 for r in results),
               "unaudited": sum(r.get("lost") is None for r in results), "kills": kills,
               "trained": sum(r.get("trained") or 0 for r in results), "wall_s": round(time.monotonic() - t0),
               "seeds": seeds, "record": str(record)}
    print(json.dumps(summary), flush=True)
    return 0 if not failed and len(results) == len(seeds) else 1


if __name__ == "__main__":
    sys.exit(main())
