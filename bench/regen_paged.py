"""Paged against fixed KV rows for regeneration on one GPU (docs/REGENERATION.md "Rows:
pages from a plan"): the same jobs, many short prompts and a few long follow-up prompts,
decoded by GreedyDecoder with the fixed layout (every row holds the longest prompt + the
answer cap, rows = what the KV budget holds of those) and with the paged cache of the same
bytes (rows set by the pages each row's own prompt and answer fill).

    python bench/regen_paged.py [--target smollm2-135m] [--short 1200] [--long 24] [--new 2048] [--out f.json]

A random-weight model of the target's shape (tools/families.py) never stops, so each job's
answer length is drawn (--mean-answer on average); the long prompts are --long-len tokens.
The budget is producers/regenerate.py kv_plan's (AUTO_KV_FRACTION of the GPU's memory).
Prints JSON lines: rows, live rows, pages, tokens/s, and how many answers the two layouts
agree on (bf16: a tie can flip a token; answers are compared whole).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_speed as ds  # noqa: E402  (sets up `dflash` from this checkout)

import torch  # noqa: E402

from dflash.decoding.core import kv_bytes_per_slot  # noqa: E402
from dflash.decoding.greedy import GreedyDecoder, Job, pack_sizes  # noqa: E402
from dflash.producers.regenerate import AUTO_ROWS_CAP, kv_plan  # noqa: E402
from dflash.tools.families import build, shape_config  # noqa: E402


def emit(row: dict, out: list) -> None:
    out.append(row)
    print(json.dumps(row), flush=True)


def run(model, jobs: list[Job], label: str, **kw) -> tuple[dict, dict]:
    dec = GreedyDecoder(model, max_prompt=kw.pop("max_prompt"), stop_ids=set(), prefill_sizes=pack_sizes(4096), **kw)
    t0 = time.perf_counter()
    dec.run(deque(Job(-1 - i, j.prompt, max_new=8) for i, j in enumerate(jobs[:64])), lambda j, o: None)
    ds.sync()
    warm = time.perf_counter() - t0
    dec.steps = 0
    outs: dict = {}
    live: list[int] = []
    left: list[Job] = []
    t = time.perf_counter()
    with dec.core.attending(), torch.inference_mode():
        for _ in dec.rounds(deque(jobs), lambda j, o: outs.__setitem__(j.key, o), left):
            live.append(dec.live)
    ds.sync()
    secs = time.perf_counter() - t
    tokens = sum(len(o) for o in outs.values())
    row = {"run": label, "rows": dec.rows, "pages": dec.book.total if dec.book else None,
           "page_size": dec.core.cache.page if dec.book else None, "kv_gib": round(dec.core.cache.nbytes / 2**30, 2),
           "kernel": dec.core.kernel, "kernel_error": dec.core.kernel_error, "graphs": dec.core.captured,
           "graph_error": dec.core.graph_error, "warmup_s": round(warm, 1), "seconds": round(secs, 2),
           "new_tokens": tokens, "tokens_per_s": round(tokens / secs), "steps": dec.steps,
           "live_rows_mean": round(sum(live) / max(1, len(live)), 1), "live_rows_max": max(live, default=0),
           "preempted": dec.preempted, "left": len(left)}
    del dec
    ds.empty_cache()
    return row, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--short", type=int, default=1200)
    ap.add_argument("--long", type=int, default=24)
    ap.add_argument("--long-len", type=int, default=2368)
    ap.add_argument("--new", type=int, default=2048)
    ap.add_argument("--mean-answer", type=int, default=565)
    ap.add_argument("--out")
    a = ap.parse_args()
    out: list = []
    model = build(shape_config(a.target), seed=0).to(ds.DEV, torch.bfloat16).eval()
    rnd = random.Random(0)
    V = model.config.vocab_size
    lens = [rnd.randint(120, 480) for _ in range(a.short)] + [a.long_len] * a.long
    rnd.shuffle(lens)
    jobs = [Job(i, [rnd.randrange(3, V) for _ in range(n)], max_new=max(1, min(a.new, int(rnd.expovariate(
        1 / a.mean_answer))))) for i, n in enumerate(lens)]
    max_prompt = -(-max(lens) // 64) * 64
    plan = kv_plan(model, ds.DEV, 0, len(jobs), max_prompt, a.new)
    per_slot = kv_bytes_per_slot(model, model.dtype)
    slots = max_prompt + a.new + 1
    kv = plan.get("kv_bytes", (plan["pages"] + 1) * plan["page_size"] * per_slot)  # a CPU plan has no bytes
    fixed_rows = max(1, min(AUTO_ROWS_CAP, kv // (slots * per_slot)))
    emit({"plan": plan, "fixed_rows": fixed_rows, "jobs": len(jobs), "mean_prompt": round(sum(lens) / len(lens)),
          "mean_answer": round(sum(j.max_new for j in jobs) / len(jobs)), "device": torch.cuda.get_device_name() if ds.DEV.type == "cuda" else "cpu"}, out)
    fixed, fo = run(model, jobs, "fixed", rows=fixed_rows, max_new_tokens=a.new, max_prompt=max_prompt)
    emit(fixed, out)
    paged, po = run(model, jobs, "paged", rows=plan["rows"], max_new_tokens=a.new, max_prompt=max_prompt,
                    kv_block=plan["page_size"], pages=plan["pages"])
    emit(paged, out)
    same = sum(fo.get(k) == po.get(k) for k in fo)
    emit({"answers_equal": same, "answers": len(fo), "speedup": round(paged["tokens_per_s"] / fixed["tokens_per_s"], 2)},
         out)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
