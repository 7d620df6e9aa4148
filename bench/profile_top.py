"""Where the Python time went in a DFLASH_BENCH_PROFILE run: the top functions by own
time in each profile of DIR, as microseconds per batch.

    DFLASH_BENCH_PROFILE=/tmp/prof python bench/transport.py --sizes 1 --modes broker
    python bench/profile_top.py /tmp/prof --batches 1500
"""

from __future__ import annotations

import argparse
import pstats
import sys
from pathlib import Path


# Waiting, not working (a thread blocked in these holds no core), and start-up.
IDLE = ("poll", "acquire", "time.sleep", "select", "wait", "_imp.create_dynamic", "marshal.loads", "builtins.exec",
        "builtins.compile", "__build_class__", "term")


def idle(fn: str) -> bool:
    return any(word in fn for word in IDLE)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--batches", type=int, required=True, help="batches the profiled run moved")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args(argv)
    for path in sorted(a.dir.glob("*.prof")):
        try:
            st = pstats.Stats(str(path))
        except (TypeError, EOFError, ValueError) as e:  # a process killed while writing its profile
            print(f"== {path.name}: unreadable ({e})")
            continue
        rows = sorted(((k, v) for k, v in st.stats.items() if not idle(k[2])),  # v: cc, nc, tottime, cumtime, callers
                      key=lambda kv: kv[1][2], reverse=True)
        total = sum(v[2] for _, v in rows)
        print(f"== {path.name}: {total / a.batches * 1e6:.0f} us/batch of Python at work (profiled; waits and "
              "start-up left out), top by own time")
        loops = [v[3] for k, v in st.stats.items() if k[2] in ("serve", "_io_loop", "consume", "produce")]
        if loops:  # the work loop's time less the waits inside it: start-up and shutdown left out
            waits = sum(v[2] for k, v in st.stats.items() if idle(k[2]) and not k[2].endswith("exec"))
            print(f"   loop at work: {(max(loops) - waits) / a.batches * 1e6:.0f} us/batch")
        for (file, line, fn), (_, calls, tottime, cumtime, _) in rows[:a.top]:
            print(f"  {tottime / a.batches * 1e6:8.1f} us  {calls / a.batches:6.2f}/batch  {Path(file).name}:{line} {fn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
