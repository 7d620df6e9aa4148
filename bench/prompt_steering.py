"""Which steering makes the target write requests of a family: measured, per method and family.

    python bench/prompt_steering.py --target FOLDER --per-family 24 --out bench/results/prompt_steering/RUN.json \
        [--steers none,opening,system,seeds] [--max-new-tokens 128] [--batch-size 64] [--threads 2]
    python bench/prompt_steering.py --rescore RUN.json --out RUN.json   # the figures again, from the rows

For each steering method (tools/prompt_writer.py) it has the target write `--per-family`
rows of every family (tools/prompt_families.py) with dflash-prompts' engine and defaults,
and records per family:

- `candidates`, `kept`, `rejected` (by reason: unfinished, empty, markup, near_duplicate, ...);
- `on_family`: the share of kept requests that meet the family's criterion (a regular
  expression over the request; a follow-up row's last request), and `on_family_written`:
  the same over the words the target wrote alone (the pre-filled opening left out, so an
  opening cannot pass the check for the target);
- diversity of the kept requests: `distinct_2` (distinct word bigrams / all bigrams),
  `mean_jaccard` (mean word-3-gram Jaccard similarity over all pairs: lower is more
  varied), `distinct_first_3` (distinct first three words / requests), `mean_words`;
- `seconds` of the method (all families) and a few `samples`.

The JSON holds every kept row too (`rows`), and the 10 most similar kept pairs of each
method below the near-duplicate threshold (what the rule lets through); stdout gets a
markdown table of it all. CPU, float32.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import time
from pathlib import Path

import click

from dflash.tools.near_dup import jaccard, shingles
from dflash.tools.prompt_families import FAMILIES, LANGUAGES, on_family
from dflash.tools.prompt_writer import STEERS, PromptWriter

_WORD = re.compile(r"\w+")


def diversity(texts: list[str]) -> dict:
    words = [_WORD.findall(t.lower()) for t in texts]
    bigrams = [tuple(w[i:i + 2]) for w in words for i in range(len(w) - 1)]
    sets = [shingles(t) for t in texts]
    pairs = list(itertools.combinations(range(len(sets)), 2))
    return {
        "distinct_2": round(len(set(bigrams)) / max(1, len(bigrams)), 4),
        "mean_jaccard": round(sum(jaccard(sets[i], sets[j]) for i, j in pairs) / max(1, len(pairs)), 4),
        "distinct_first_3": round(len({tuple(w[:3]) for w in words}) / max(1, len(words)), 4),
        "mean_words": round(sum(map(len, words)) / max(1, len(words)), 1),
    }


def closest_pairs(texts: list[str], n: int = 10) -> list[dict]:
    sets = [shingles(t) for t in texts]
    scored = sorted(((jaccard(sets[i], sets[j]), i, j) for i, j in itertools.combinations(range(len(sets)), 2)),
                    reverse=True)[:n]
    return [{"jaccard": round(s, 3), "a": texts[i], "b": texts[j]} for s, i, j in scored]


def opening_of(family, request: str) -> str:
    """The family opening `request` starts with (the longest, `{lang}` matched), else ""."""
    best = ""
    for o in family.openings:
        m = re.match(re.escape(o).replace(r"\{lang\}", "(?:" + "|".join(map(re.escape, LANGUAGES)) + ")"), request)
        if m and len(m.group(0)) > len(best):
            best = m.group(0)
    return best


def score(method: dict, steer: str) -> dict:
    """The per-family figures of a method from its kept rows (and tallies): re-run on a saved
    result when the criteria change (`--rescore`)."""
    every = []
    for name, f in method["families"].items():
        fam = FAMILIES[name]
        rows = [r for r in method["rows"] if r["family"] == name]
        requests = [r["messages"][-1]["content"] for r in rows]
        openings = [r.get("opening", opening_of(fam, q) if steer == "opening" else "") for r, q in zip(rows, requests)]
        written = [q[len(o):] for q, o in zip(requests, openings)]
        every += requests
        f.update({
            "on_family": round(sum(on_family(fam, q) for q in requests) / max(1, len(requests)), 4),
            "on_family_written": round(sum(on_family(fam, q) for q in written) / max(1, len(written)), 4),
            **diversity(requests), "samples": requests[:5],
        })
    method["closest_pairs"] = closest_pairs(every)
    return method


def measure(writer: PromptWriter, per_family: int, families: list[str]) -> dict:
    t0 = time.monotonic()
    tallies = writer.write({f: per_family for f in families})
    seconds = time.monotonic() - t0
    out, rows = {}, []
    for name, t in tallies.items():
        out[name] = {"candidates": t.tried, "kept": len(t.kept), "rejected": dict(t.dropped),
                     "kept_rate": round(len(t.kept) / max(1, t.tried), 4), "answers_cut": t.answers_cut}
        rows += [{"family": name, "opening": r.opening, "messages": r.messages} for r in t.kept[:per_family]]
    return score({"seconds": round(seconds, 1), "families": out, "rows": rows}, writer.steer)


def table(result: dict) -> str:
    """A markdown table of the result: one row per method and family, then each method's means."""
    lines = ["| method | family | kept / candidates | unfinished | near-dup | on-family | on-family (written) | "
             "distinct-2 | mean Jaccard | distinct first 3 | words |", "|" + " --- |" * 11]
    for steer, m in result["methods"].items():
        fams = m["families"]
        for name, f in list(fams.items()) + [("**mean**", None)]:
            if f is None:
                f = {k: sum(x[k] for x in fams.values()) / len(fams) for k in ("kept_rate", "on_family",
                     "on_family_written", "distinct_2", "mean_jaccard", "distinct_first_3", "mean_words")}
                f |= {"kept": sum(x["kept"] for x in fams.values()), "candidates": sum(x["candidates"] for x in
                      fams.values()), "rejected": {k: sum(x["rejected"].get(k, 0) for x in fams.values())
                                                   for k in ("unfinished", "near_duplicate")}}
            lines.append(f"| {steer} | {name} | {f['kept']} / {f['candidates']} | {f['rejected'].get('unfinished', 0)} | "
                         f"{f['rejected'].get('near_duplicate', 0)} | {f['on_family']:.2f} | {f['on_family_written']:.2f} "
                         f"| {f['distinct_2']:.2f} | {f['mean_jaccard']:.3f} | {f['distinct_first_3']:.2f} | "
                         f"{f['mean_words']:.1f} |")
    return "\n".join(lines)


@click.command()
@click.option("--target", default=None, help="A Hugging Face folder (e.g. `python -m dflash.tools.real_target --hf`).")
@click.option("--per-family", default=24, show_default=True, help="Rows to keep per family and method.")
@click.option("--steers", default=",".join(STEERS), show_default=True, help="Methods to measure, in order.")
@click.option("--families", default=",".join(FAMILIES), show_default=True)
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--answer-tokens", default=256, show_default=True)
@click.option("--temperature", default=1.0, show_default=True)
@click.option("--batch-size", "rows", default=64, show_default=True)
@click.option("--threads", default=2, show_default=True, help="torch CPU threads.")
@click.option("--seed", default=0, show_default=True)
@click.option("--rescore", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Recompute the figures of a saved result from its rows (no model) and write --out.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="JSON written after every method.")
def main(target, per_family, steers, families, max_new_tokens, answer_tokens, temperature, rows, threads, seed,
         rescore, out) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    if rescore:
        result = json.loads(Path(rescore).read_text())
        for steer, m in result["methods"].items():
            score(m, steer)
        path.write_text(json.dumps(result, indent=1))
        print(table(result))
        return
    if not target:
        raise click.UsageError("--target is needed (or --rescore FILE)")
    import torch

    from dflash.runtime.targets import load_causal_lm, load_tokenizer

    torch.set_num_threads(threads)
    tok = load_tokenizer(target)
    model = load_causal_lm(target, dtype=torch.float32).eval()
    result = {"target": target, "per_family": per_family, "max_new_tokens": max_new_tokens,
              "answer_tokens": answer_tokens, "temperature": temperature, "batch_size": rows, "seed": seed,
              "methods": {}}
    for steer in steers.split(","):
        writer = PromptWriter(model, tok, steer=steer, max_new_tokens=max_new_tokens, answer_tokens=answer_tokens,
                              temperature=temperature, rows=rows, seed=seed)
        result["methods"][steer] = measure(writer, per_family, families.split(","))
        path.write_text(json.dumps(result, indent=1))
        print(f"{steer}: {result['methods'][steer]['seconds']} s", file=sys.stderr, flush=True)
    print(table(result))


if __name__ == "__main__":
    main()
