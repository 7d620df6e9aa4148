"""What regeneration's speed should be, from measured costs: a model of GreedyDecoder's
rounds (continuous batching, a refill once `refill_min` rows are free, `sync_every` steps
per round) over real prompt lengths, priced with a decode step's cost (fixed part plus a
cost per cache slot, `decode_speed.py --sections where`) and a prefill forward's cost.

    python bench/regen_model.py --tokenizer DIR [--gguf-file F] --data P/train.jsonl \
        --step-ms 4.29 --slot-us 5.57 --eager-ms 98 --replay-ms 5

A planning tool, not a measurement: answer lengths are drawn (a share at the cap, the
rest uniform), and a prefill's cost is taken as one figure per forward whatever its size
(true where the host, not the GPU, is the limit: a small target). Prints new tokens/s for
eager prefills (one forward per 64 refilled rows) and for packed, graphed ones (one replay
per `--pack` tokens).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics


def prompt_lengths(tokenizer: str, gguf_file: str | None, data: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer, **({"gguf_file": gguf_file} if gguf_file else {}))
    with open(data) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [len(tok(tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False)["input_ids"]) for r in rows]


def simulate(lens: list[int], answers: list[int], *, rows: int, sync_every: int, refill_min: int, step_ms: float,
             prefill_ms: float, pack: int | None) -> dict:
    """GreedyDecoder.rounds, timed: `pack` None prices one forward per 64 refilled rows,
    else one per `pack` tokens of refilled prompts."""
    jobs, busy, free, step, forwards, new, t = list(range(len(lens))), {}, rows, 0, 0, 0, 0.0
    while jobs or busy:
        if jobs and free and (free >= refill_min or not busy or len(jobs) <= free):
            take = [jobs.pop(0) for _ in range(min(free, len(jobs)))]
            busy.update((j, step) for j in take)
            free -= len(take)
            n = -(-len(take) // 64) if pack is None else max(1, -(-sum(lens[j] for j in take) // pack))
            forwards += n
            t += n * prefill_ms
        step += sync_every
        t += sync_every * step_ms
        for j, s0 in list(busy.items()):
            if step - s0 >= answers[j] - 1:  # the first token came from the prefill
                del busy[j]
                new += answers[j]
                free += 1
    return {"new_tokens": new, "seconds": round(t / 1e3, 2), "tokens_per_s": round(new / t * 1e3),
            "prefill_forwards": forwards, "steps": step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--data", required=True, help="prompts (JSONL of messages), as regeneration reads them")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--at-cap", type=float, default=0.6, help="share of answers that run to --max-new-tokens")
    ap.add_argument("--step-ms", type=float, required=True, help="a decode step's fixed part at --rows rows")
    ap.add_argument("--slot-us", type=float, required=True, help="its cost per cache slot")
    ap.add_argument("--eager-ms", type=float, required=True, help="one eager prefill forward")
    ap.add_argument("--replay-ms", type=float, required=True, help="one graphed prefill replay")
    ap.add_argument("--pack", type=int, default=4096, help="tokens per packed prefill")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    lens = prompt_lengths(a.tokenizer, a.gguf_file, a.data)
    rng = random.Random(a.seed)
    cap = a.max_new_tokens
    answers = [cap if rng.random() < a.at_cap else rng.randint(cap // 5, cap) for _ in lens]
    slots = -(-max(lens) // 64) * 64 + cap + 1  # Regenerator.prompt_slots, one turn
    step_ms = a.step_ms + a.slot_us * slots / 1e3
    print(json.dumps({"prompts": len(lens), "prompt_mean": round(statistics.mean(lens), 1), "prompt_max": max(lens),
                      "answer_mean": round(statistics.mean(answers), 1), "slots": slots,
                      "step_ms": round(step_ms, 3)}))
    common = dict(rows=a.rows, sync_every=8, refill_min=max(1, a.rows // 16), step_ms=step_ms)
    for name, kw in (("eager prefills", dict(prefill_ms=a.eager_ms, pack=None)),
                     ("graphed packed prefills", dict(prefill_ms=a.replay_ms, pack=a.pack))):
        print(json.dumps({"prefills": name, **simulate(lens, answers, **common, **kw)}))


if __name__ == "__main__":
    main()
