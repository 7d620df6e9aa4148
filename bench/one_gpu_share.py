"""One GPU shared by regeneration and training, as the README's one-GPU path runs it: does
the drafter wait for batches?

    python bench/one_gpu_share.py --target T.gguf --prompts 20000 --seconds 330 --work /tmp/share

Builds N prompts (bench/real_prompts.py, user turns only, so every answer is regenerated),
then runs `dflash-broker --epochs 1 --consumers 1`, `dflash-produce --regenerate` and
`dflash-consume` on GPU 0 with their defaults (bench/real_quality.py's `train`) for
--seconds, and reads the run's logs: the consumer's share of wall time spent waiting for a
batch (train.step `wait_s` / `wall_s`) over the whole run and after its first minute of
steps, in 30-s windows; the broker's diagnosis codes (broker.progress) in the same windows;
the producer's regeneration rate (produce.regen_progress). One JSON object on stdout.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import click

import real_prompts
import real_quality


def _lines(path: Path, event: str) -> list[dict]:
    out = []
    for x in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if x.startswith("{") and f'"{event}"' in x:
            try:
                out.append(json.loads(x))
            except ValueError:
                pass
    return out


def _t(ev: dict) -> float:
    return datetime.fromisoformat(ev["ts"].replace("Z", "+00:00")).timestamp()


def windows(steps: list[dict], t0: float, width: float = 30.0) -> list[dict]:
    out: dict[int, list[float]] = {}
    for s in steps:
        w = int((_t(s) - t0) // width)
        acc = out.setdefault(w, [0.0, 0.0, 0])
        acc[0] += s.get("wait_s") or 0.0
        acc[1] += s.get("wall_s") or 0.0
        acc[2] += 1
    return [{"from_s": int(w * width), "steps": n, "wait_frac": round(a / b, 3) if b else None}
            for w, (a, b, n) in sorted(out.items())]


@click.command()
@click.option("--target", required=True)
@click.option("--prompts", "n_prompts", default=20000)
@click.option("--seconds", default=330.0)
@click.option("--work", default="/tmp/dflash-share")
@click.option("--gpu", default=0, help="GPU of all three roles; -1: CPU (a smoke test of the script).")
def main(target, n_prompts, seconds, work, gpu) -> None:
    from transformers import AutoTokenizer

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    g = Path(target)
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    rows, _ = real_prompts.build(tok, n_prompts, 0, 0)
    real_prompts.write_jsonl(work / "train.jsonl", rows)
    env = {**os.environ, "DFLASH_LOG_JSON": "1"}
    t0 = time.time()
    res = real_quality.train(work, target, work / "train.jsonl", 1, work / "regen", gpu,
                              ["--max-new-tokens", "16"] if gpu < 0 else [], [], seconds, env)
    steps = [s for s in _lines(work / "consumer.out", "train.step") if s.get("rank", 0) == 0]
    first = _t(steps[0]) if steps else t0
    late = [s for s in steps if _t(s) - first >= 60]

    def frac(ss):
        wall = sum(s.get("wall_s") or 0 for s in ss)
        return round(sum(s.get("wait_s") or 0 for s in ss) / wall, 4) if wall else None

    progress = _lines(work / "broker.out", "broker.progress")
    regen = _lines(work / "producer.out", "produce.regen_progress")
    rows_lines = _lines(work / "producer.out", "produce.regen_rows")
    print(json.dumps({
        **res, "prompts": n_prompts, "first_step_after_s": round(first - t0, 1),
        "wait_frac_all": frac(steps), "wait_frac_after_first_minute": frac(late), "steps_after_first_minute": len(late),
        "tokens_per_s_after_first_minute": round(sum(s["tokens"] for s in late) / max(1e-9, sum(
            s.get("wall_s") or 0 for s in late))) if late else None,
        "windows": windows(steps, first),
        "diagnosis": [{"from_s": round(_t(p) - first), "code": p.get("diagnosis"), "queue": p.get("queue_batches"),
                       "samples_trained": p.get("samples_trained")} for p in progress],
        "diagnosis_counts_after_first_minute": dict(Counter(p.get("diagnosis") for p in progress
                                                            if _t(p) - first >= 60)),
        "regen": [{k: r.get(k) for k in ("rows", "new_tokens", "tokens_per_s", "running")} for r in regen],
        "regen_rows": [{k: r.get(k) for k in ("rows", "jobs", "slots", "source")} for r in rows_lines],
    }))


if __name__ == "__main__":
    main()
