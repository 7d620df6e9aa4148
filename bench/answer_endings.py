"""How the target's greedy answers end: by EOS, by running to the cap, and of those how many
loop (the same n-gram again and again) and from where. Issue 35 item 2.

    python bench/answer_endings.py decode --target FOLDER --prompts ROWS.json --out RUN.json \
        [--max-new-tokens 1024] [--rows 32] [--threads 2] [--limit N]
    python bench/answer_endings.py analyse RUN.json [--md] [--eval-tokens 256]

`decode` answers every prompt greedily with the producers' own decoder and stop tokens
(decoding/greedy.py GreedyDecoder, producers/regenerate.py stop_ids), the chat template
applied as `--regenerate` applies it, to `--max-new-tokens` with no ending rule, and writes
the prompts, the answers' token IDs and the seconds to RUN.json. `--prompts` is a JSON list
of chat rows ({"family", "messages"}) or a prompt_steering result (its `opening` method's
rows: what `dflash-prompts` writes by default). The last user turn of each row is answered.

`analyse` reads RUN.json and prints one JSON object (or a markdown table with `--md`):
per family and overall, answers that ended by EOS, that hit the cap, and of the capped ones
how many decoding/endings.py `repetition_start` flags (its default rule) and where the loop
starts (the kept length); the new tokens the rule saves; and the same over several rules,
so a choice of rule is measured, not guessed. `repeats_in_eval`: of the first `--eval-tokens`
of each answer (what dflash-eval decodes), the share that repeat a loop already said once:
tokens a drafter trained with `--regen-loop-keep copy` never saw an anchor in.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import click


@click.group()
def main() -> None:
    pass


def _rows(path: str) -> list[dict]:
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):  # a bench/prompt_steering.py result: dflash-prompts' default method
        data = data["methods"]["opening"]["rows"]
    return [{"family": r.get("family", "-"), "messages": r["messages"]} for r in data]


@main.command()
@click.option("--target", required=True, help="Model folder (python -m dflash.tools.real_target --hf).")
@click.option("--prompts", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--out", required=True, type=click.Path(dir_okay=False))
@click.option("--max-new-tokens", default=1024)
@click.option("--rows", default=24, help="Decoder rows (continuous batching).")
@click.option("--threads", default=2)
@click.option("--limit", default=0, help="Only the first N prompts of the shuffled order (0: all).")
@click.option("--skip", default=0, help="Leave out the first N prompts of the shuffled order (another run's).")
@click.option("--budget-s", default=0.0, help="Start no prompt after this many seconds (0: no limit); the "
              "prompts started are decoded to their end, so the answers are a random sample of the prompts.")
@click.option("--deadline-s", default=0.0, help="Stop decoding after this many seconds (0: none); rows still "
              "decoding then are counted as censored and left out.")
@click.option("--seed", default=0, help="Shuffles the prompts, so that any prefix of them is a fair sample.")
def decode(target, prompts, out, max_new_tokens, rows, threads, limit, skip, budget_s, deadline_s, seed) -> None:
    """Answers to --max-new-tokens, except that a row whose last 256 tokens loop (STOP_RULE) stops:
    such a loop is far past the default rule's point, and decoding it to the cap would only
    repeat it (CPU time is scarce). Analyse counts such rows as answers that ran to the cap."""
    import random
    from collections import deque

    import torch

    from dflash.decoding.endings import EndingRule
    from dflash.decoding.greedy import GreedyDecoder, Job
    from dflash.producers.regenerate import stop_ids
    from dflash.runtime.targets import load_causal_lm, load_tokenizer

    torch.set_num_threads(threads)
    tok = load_tokenizer(target)
    model = load_causal_lm(target, dtype=torch.float32).eval()
    items = _rows(prompts)
    random.Random(seed).shuffle(items)
    items = items[skip:][:limit or None]
    ids = [tok(tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"] for r in items]
    stops = sorted(stop_ids(model, tok))
    stop_rule = EndingRule(**STOP_RULE)
    dec = GreedyDecoder(model, rows=min(rows, len(ids)), max_prompt=max(map(len, ids)),
                        max_new_tokens=max_new_tokens, stop_ids=stops, ending=stop_rule)
    answers: dict[int, list[int]] = {}
    jobs = deque(Job(i, p) for i, p in enumerate(ids))
    started, cleared = 0, False
    t0 = time.monotonic()
    leftover: list = []
    with dec.core.attending(), torch.inference_mode():
        for _ in dec.rounds(jobs, lambda j, o: answers.__setitem__(j.key, o), leftover):
            el = time.monotonic() - t0
            if not cleared:  # those left in `jobs` were never started
                started = len(ids) - len(jobs)
                if budget_s and el > budget_s:
                    jobs.clear()
                    cleared = True
            if deadline_s and el > deadline_s:
                break
            if dec.steps % 256 == 0:
                print(f"{el:.0f} s: {dec.steps} steps, {len(answers)} answers, {started} started", file=sys.stderr,
                      flush=True)
    secs = time.monotonic() - t0
    result = {"target": target, "prompts": prompts, "seed": seed, "skip": skip, "max_new_tokens": max_new_tokens,
              "stop_ids": stops, "stop_rule": stop_rule.describe(), "rows": dec.rows, "threads": threads,
              "seconds": round(secs, 1), "steps": dec.steps, "prompts_total": len(ids), "started": started,
              "censored": started - len(answers),
              "answers": [{"family": items[i]["family"], "messages": items[i]["messages"],
                           "prompt_tokens": len(ids[i]), "ids": a} for i, a in sorted(answers.items())]}
    Path(out).write_text(json.dumps(result))
    print(f"{len(answers)} answers ({started - len(answers)} censored), {sum(map(len, answers.values()))} new "
          f"tokens in {secs:.0f} s", file=sys.stderr)


STOP_RULE = {"tail": 256, "max_period": 64, "repeats": 4}


def summarise(run: dict, rule, eval_tokens: int = 256) -> dict:
    """Per family and overall: how the uncut answers ended, and what the decoder with `rule`
    would have kept of them (endings.decoded_ending: checked at its sync points)."""
    from dataclasses import replace

    from dflash.decoding.endings import CAP, COPY, EOS, REPETITION, decoded_ending

    stops = set(run["stop_ids"])
    fams: dict[str, list] = {}
    for a in run["answers"]:
        fams.setdefault(a["family"], []).append(a)
    fams["all"] = run["answers"]
    out = {}
    for fam, answers in fams.items():
        uncut = [EOS if a["ids"] and a["ids"][-1] in stops else CAP for a in answers]
        # a row the decode stopped on a long loop would have run to the cap
        lens = [len(a["ids"]) if u == EOS else run["max_new_tokens"] for a, u in zip(answers, uncut)]
        ruled = [decoded_ending(a["ids"], stops, rule) for a in answers]
        firsts = [decoded_ending(a["ids"], stops, replace(rule, keep=COPY))[1] for a in answers]
        eos = [n for n, u in zip(lens, uncut) if u == EOS]
        loops = [k for u, k, (r, _, _) in zip(uncut, firsts, ruled) if u == CAP and r == REPETITION]
        # a looping answer repeats from its first copy on (to the cap, had it not been stopped)
        shown = [min(n, eval_tokens) for n in lens]
        repeats = [max(0, s - k) if u == CAP and r == REPETITION else 0
                   for s, k, u, (r, _, _) in zip(shown, firsts, uncut, ruled)]
        out[fam] = {
            "answers": len(answers), "mean_tokens": round(statistics.mean(lens), 1),
            "eos": len(eos), "eos_median_tokens": int(statistics.median(eos)) if eos else None,
            "cap": uncut.count(CAP), "cap_looping": len(loops), "cap_not_looping": uncut.count(CAP) - len(loops),
            "loop_start_median": int(statistics.median(loops)) if loops else None,
            "loop_start_quartiles": [int(x) for x in statistics.quantiles(loops, n=4)] if len(loops) > 1 else None,
            # answers that would have ended by EOS but the rule cut (its false positives)
            "eos_answers_cut": sum(1 for u, (r, _, _) in zip(uncut, ruled) if u == EOS and r == REPETITION),
            "mean_tokens_decoded_with_rule": round(statistics.mean(d for _, _, d in ruled), 1),
            "mean_tokens_kept_with_rule": round(statistics.mean(k for _, k, _ in ruled), 1),
            "decode_saved": round(1 - sum(d for _, _, d in ruled) / max(1, sum(lens)), 3),
            "repeats_in_eval": round(sum(repeats) / max(1, sum(shown)), 3),
            "repeats_in_eval_per_answer": round(statistics.mean(r / s for r, s in zip(repeats, shown)), 3),
            "answers_repeating_in_eval": sum(1 for r in repeats if r),
            # how varied the last 256 tokens of the unended, unlooped answers are (1: no 4-gram twice)
            "cap_not_looping_tail_distinct4": _median([_distinct4(a["ids"][-256:]) for a, u, (r, _, _)
                                                       in zip(answers, uncut, ruled) if u == CAP and r != REPETITION]),
        }
    return out


def _distinct4(ids: list[int]) -> float:
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)) / max(1, len(grams))


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


RULES = [  # (name, EndingRule kwargs): the default and its neighbours
    ("default", {}),
    ("tail128", {"tail": 128}),
    ("tail32", {"tail": 32}),
    ("period16", {"max_period": 16}),
    ("period128", {"max_period": 128}),
]


@main.command()
@click.argument("run_files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--md", is_flag=True, default=False, help="A markdown table instead of JSON.")
@click.option("--samples", default=0, help="Also print the decoded tails of N looping and N unended answers.")
@click.option("--eval-tokens", default=256, help="New tokens dflash-eval decodes, for repeats_in_eval.")
def analyse(run_files, md, samples, eval_tokens) -> None:
    from dflash.decoding.endings import REPETITION, EndingRule, decoded_ending

    runs = [json.loads(Path(f).read_text()) for f in run_files]
    run = dict(runs[0])  # several runs (--skip: other prompts of the same order) analysed as one
    for r in runs[1:]:
        if (r["max_new_tokens"], r["stop_ids"]) != (run["max_new_tokens"], run["stop_ids"]):
            raise click.UsageError("the runs differ in --max-new-tokens or stop tokens")
        run["answers"] = run["answers"] + r["answers"]
        run["seconds"] += r["seconds"]
        run["censored"] = run.get("censored", 0) + r.get("censored", 0)
    if samples:
        from dflash.runtime.targets import load_tokenizer

        tok = load_tokenizer(run["target"])
        stops = set(run["stop_ids"])
        for want in (REPETITION, "cap"):
            got = [a for a in run["answers"] if a["ids"][-1] not in stops
                   and decoded_ending(a["ids"], stops, EndingRule())[0] == want][:samples]
            for a in got:
                r, keep, _ = decoded_ending(a["ids"], stops, EndingRule())
                print(f"--- {a['family']} {r} kept {keep}: {a['messages'][-1]['content'][:100]!r}\n"
                      f"[...] {tok.decode(a['ids'][max(0, keep - 120):keep])!r}\n>>> cut: "
                      f"{tok.decode(a['ids'][keep:keep + 80])!r}" if r == REPETITION else
                      f"--- {a['family']} cap: {a['messages'][-1]['content'][:100]!r}\n[...] "
                      f"{tok.decode(a['ids'][-200:])!r}", file=sys.stderr)
    res = {"max_new_tokens": run["max_new_tokens"], "seconds": run["seconds"], "rows": run["rows"],
           "answers": len(run["answers"]), "censored": run.get("censored", 0),
           "stopped_on_long_loop": sum(1 for a in run["answers"] if a["ids"][-1] not in run["stop_ids"]
                                       and len(a["ids"]) < run["max_new_tokens"]),
           "eval_tokens": eval_tokens,
           "rules": {name: {"rule": EndingRule(**kw).describe(), "families": summarise(run, EndingRule(**kw),
                                                                                       eval_tokens)}
                     for name, kw in RULES}}
    if not md:
        print(json.dumps(res, indent=1))
        return
    fams = res["rules"]["default"]["families"]
    print(f"default rule: {res['rules']['default']['rule']}\n")
    print("| family | answers | mean tokens | EOS | EOS median | cap | cap, looping | cap, not looping "
          "| loop kept length median (quartiles) | EOS answers cut | mean decoded with rule | mean kept | decode saved | unended tail distinct 4-grams |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for fam, f in fams.items():  # loop start: the kept length with keep=copy (the block said once)
        print(f"| {fam} | {f['answers']} | {f['mean_tokens']} | {f['eos']} | {f['eos_median_tokens']} | {f['cap']} "
              f"| {f['cap_looping']} | {f['cap_not_looping']} | {f['loop_start_median']} ({f['loop_start_quartiles']}) "
              f"| {f['eos_answers_cut']} | {f['mean_tokens_decoded_with_rule']} | {f['mean_tokens_kept_with_rule']} "
              f"| {f['decode_saved']} | {f['cap_not_looping_tail_distinct4']} |")
    print(f"\n| family | answers repeating within {eval_tokens} tokens | repeats, of all tokens | per answer |")
    print("|---|---|---|---|")
    for fam, f in fams.items():
        print(f"| {fam} | {f['answers_repeating_in_eval']} | {f['repeats_in_eval']} | {f['repeats_in_eval_per_answer']} |")
    print("\n| rule | cap, looping | cap, not looping | EOS answers cut | mean decoded | decode saved |")
    print("|---|---|---|---|---|---|")
    for name, r in res["rules"].items():
        a = r["families"]["all"]
        print(f"| {name}: {r['rule']} | {a['cap_looping']} | {a['cap_not_looping']} | {a['eos_answers_cut']} "
              f"| {a['mean_tokens_decoded_with_rule']} | {a['decode_saved']} |")


if __name__ == "__main__":
    main()
