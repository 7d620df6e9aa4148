"""A series of chaos runs (issue 19 "Must show": 20 consecutive random-seed runs pass): draws
--runs seeds (or takes --seeds), runs test_chaos.py's short form once per seed exactly as CI
does (pytest, DFLASH_CHAOS_SEED), and records per seed whether it passed and what the test
read from the ledgers and the final checkpoint's record: lost, duplicated, committed, in the
final weights, kills survived, wall time.

    python tests/reliability/chaos_series.py --runs 20
    python tests/reliability/chaos_series.py --seeds 525848415,12   # replay given seeds

The seeds are printed before the first run, so a series can be replayed. Every result is
appended as a JSON line to --record as it ends (a series cut short keeps what it did); the
last stdout line is a JSON summary. The exit status is 0 only when every run passed. A
failed run's pytest output and its working folder (--keep, default under /tmp) stay for the
post-mortem.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEST = HERE / "test_chaos.py"
TIMEOUT_S = 1200  # one run, pytest included; the test's own bound is shorter

# The lines test_chaos.py prints (with -s) after its audit.
LOST = re.compile(r"samples lost: (\d+), samples duplicated: (\d+), committed (\d+)/(\d+), in the final weights (\d+)")
KILLS = re.compile(r"kills survived: (\{.*?\}) \(planned (\[.*?\])\)")
CHAIN = re.compile(r"runs in the chain: (\d+);")


def parse(output: str) -> dict:
    """What the test printed: lost, duplicated, committed, expected, trained, kills, runs."""
    out: dict = {"lost": None, "duplicated": None}
    m = LOST.search(output)
    if m:
        out.update(lost=int(m[1]), duplicated=int(m[2]), committed=int(m[3]), expected=int(m[4]), trained=int(m[5]))
    m = KILLS.search(output)
    if m:
        out.update(kills=m[1].replace("Counter(", "").rstrip(")"), plan=m[2])
    m = CHAIN.search(output)
    if m:
        out["runs_in_chain"] = int(m[1])
    return out


def run_one(seed: int, work: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env["DFLASH_CHAOS_SEED"] = str(seed)  # the short form: no DFLASH_LONG, no DFLASH_CHAOS_KILLS
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(TEST),
                            "--basetemp", str(work / "tmp")], capture_output=True, text=True,
                           timeout=TIMEOUT_S, env=env, cwd=HERE.parent.parent)
        output, code = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        code = None
    (work / "pytest.out").write_text(output)
    res = {"seed": seed, "exit": code, "wall_s": round(time.monotonic() - t0), **parse(output)}
    # A pass whose figures cannot be read is not counted as one: the series reports them.
    res["passed"] = code == 0 and res["lost"] == 0 and res["duplicated"] == 0
    if not res["passed"]:
        fail = [ln for ln in output.splitlines() if ln.startswith("E ")]
        res["error"] = " | ".join(fail[:3])[:600] or output[-600:]
        res["output"] = str(work / "pytest.out")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=20, help="random seeds to draw (default 20)")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds to run instead of drawing")
    ap.add_argument("--record", type=Path, default=None, help="JSON lines, one per run (default: in --keep)")
    ap.add_argument("--keep", type=Path, default=None, help="working folders (default: a new one under /tmp)")
    ap.add_argument("--stop-on-fail", action="store_true", help="end the series at the first failed run")
    args = ap.parse_args(argv)
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
    keep = args.keep or Path(tempfile.mkdtemp(prefix="dflash-chaos-series-"))
    keep.mkdir(parents=True, exist_ok=True)
    record = args.record or keep / "series.jsonl"
    print(f"chaos series: {len(seeds)} runs of {TEST.name} (short form), seeds {','.join(map(str, seeds))}; "
          f"record {record}, folders in {keep}", flush=True)
    results = []
    t0 = time.monotonic()
    for i, seed in enumerate(seeds, 1):
        res = run_one(seed, keep / f"{i:02d}-{seed}")
        results.append(res)
        with open(record, "a") as f:
            f.write(json.dumps(res) + "\n")
        print(f"[{i}/{len(seeds)}] seed {seed}: {'PASS' if res['passed'] else 'FAIL'} lost {res['lost']} "
              f"duplicated {res['duplicated']} committed {res.get('committed')}/{res.get('expected')} "
              f"trained {res.get('trained')} kills {res.get('kills')} runs {res.get('runs_in_chain')} "
              f"{res['wall_s']} s" + (f"  {res['error']}" if not res["passed"] else ""), flush=True)
        if args.stop_on_fail and not res["passed"]:
            break
    failed = [r["seed"] for r in results if not r["passed"]]
    summary = {"runs": len(results), "passed": len(results) - len(failed), "failed_seeds": failed,
               "lost": sum(r["lost"] or 0 for r in results), "duplicated": sum(r["duplicated"] or 0 for r in results),
               "unaudited": sum(r["lost"] is None for r in results), "wall_s": round(time.monotonic() - t0),
               "seeds": seeds, "record": str(record)}
    print(json.dumps(summary), flush=True)
    return 0 if not failed and len(results) == len(seeds) else 1


if __name__ == "__main__":
    sys.exit(main())
