"""`dflash-prompts`: the target writes a broad prompt set itself, for a user who has no data.

    dflash-prompts --target T --count 20000 --out prompts.jsonl [--holdout 8] [--gpu 0]

The target writes user requests of seven task families (tools/prompt_families.py:
programming, maths, reasoning, writing, factual, constraints, follow_up), steered through
its own chat template (tools/prompt_writer.py; by default each user turn is pre-filled with
a family's first words). Families are balanced (`--families` chooses and weights them);
near-duplicates are removed (tools/near_dup.py), every rejection is counted per family and
reason, and a family that falls short within `--max-tries` candidates is an error, not a
smaller file.

Output: chat rows {"id": "self-<n>", "family": F, "messages": [...]}, the producer's `--data`
format (a follow-up row ends in its second user turn; `--regenerate` answers both turns),
families interleaved. `--holdout N` writes N more rows per family to a second file
(`--holdout-out`, default OUT with `.holdout` before the suffix), never in the training file
and no near-duplicate of any row in it, families interleaved so that `dflash-consume
--eval-prompts FILE --eval-limit K` sees every family in its first K. stdout is one JSON
report (the counts per family); logs and the progress bar go to stderr.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import click

from dflash.runtime.command_line import target_callback

from .prompt_families import FAMILIES, FamilySpecError, parse_families, split_count
from .prompt_writer import STEERS, FamilyTally, PromptError, PromptWriter, Written


def holdout_path(out: Path) -> Path:
    """prompts.jsonl -> prompts.holdout.jsonl."""
    return out.with_name(f"{out.stem}.holdout{out.suffix or '.jsonl'}")


def split_rows(tallies: dict[str, FamilyTally], wants: dict[str, int],
               holdout: int) -> tuple[list[Written], list[Written], int]:
    """(training rows, held-out rows, surplus): the first `holdout` rows kept of each family are
    held out, the next `wants[family]` train; rows kept past that (the last round's headroom)
    are the surplus, written nowhere. Both lists interleave the families."""
    train: dict[str, list[Written]] = {}
    held: dict[str, list[Written]] = {}
    surplus = 0
    for name, t in tallies.items():
        held[name] = t.kept[:holdout]
        train[name] = t.kept[holdout:holdout + wants[name]]
        surplus += len(t.kept) - len(held[name]) - len(train[name])
    return interleave(train), interleave(held), surplus


def interleave(by_family: dict[str, list[Written]]) -> list[Written]:
    """One row of each family in turn, by its share: family f's i-th row goes at (i + 0.5) / n_f."""
    keyed = [((i + 0.5) / len(rows), k, row) for k, rows in enumerate(by_family.values()) for i, row in enumerate(rows)]
    return [row for *_, row in sorted(keyed, key=lambda x: (x[0], x[1]))]


def write_jsonl(path: Path, rows: list[Written], prefix: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text("".join(json.dumps({"id": f"{prefix}-{i}", "family": r.family, "messages": r.messages}) + "\n"
                           for i, r in enumerate(rows)))
    tmp.replace(path)


def family_counts(tallies: dict[str, FamilyTally], train: list[Written], held: list[Written]) -> dict:
    return {name: {"train": sum(r.family == name for r in train), "holdout": sum(r.family == name for r in held),
                   "candidates": t.tried, "kept": len(t.kept), "rejected": dict(t.dropped),
                   **({"answers_cut": t.answers_cut} if FAMILIES[name].follow_up else {})}
            for name, t in tallies.items()}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--target", required=True, callback=target_callback(need_tokenizer=True),
              help="The target: a Hugging Face folder or name, or a .gguf file.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="JSONL file to write (chat rows).")
@click.option("--count", required=True, type=click.IntRange(1), help="Training prompts to write, over all families.")
@click.option("--families", default="all", show_default=True,
              help=f"Families and weights, NAME[=WEIGHT],... of: {', '.join(FAMILIES)}; --count is shared by weight.")
@click.option("--holdout", default=0, show_default=True, type=click.IntRange(0),
              help="Also write N prompts per family to --holdout-out, for live evaluation (never in --out).")
@click.option("--holdout-out", default=None, type=click.Path(dir_okay=False),
              help="The held-out file [default: OUT with .holdout before the suffix].")
@click.option("--steer", type=click.Choice(STEERS), default="opening", show_default=True,
              help="How a family is asked for: opening (pre-filled first words), system (a system prompt "
              "describing the user), seeds (example requests in a system prompt), none (unsteered).")
@click.option("--max-new-tokens", default=128, show_default=True, help="Longest prompt; longer candidates are dropped.")
@click.option("--answer-tokens", default=256, show_default=True,
              help="Longest answer a follow-up is written after (a longer one is cut there and counted).")
@click.option("--temperature", default=1.0, show_default=True, help="Sampling temperature.")
@click.option("--top-k", default=0, show_default=True, help="Sample among the k likeliest tokens (0: all).")
@click.option("--near-dup", default=0.6, show_default=True, type=click.FloatRange(0, 1, min_open=True),
              help="Drop a prompt whose word-3-gram Jaccard similarity to a kept one is at least this.")
@click.option("--batch-size", "rows", default=256, show_default=True, help="Rows decoded at once.")
@click.option("--max-tries", default=None, type=int,
              help="Candidates to try at most [default: 4 x the prompts wanted, held-out ones included].")
@click.option("--exclude", multiple=True, help="Drop prompts matching this regular expression (case ignored); "
              "repeatable, e.g. to keep an evaluation's task families out of training.")
@click.option("--seed", default=0, show_default=True,
              help="Random seed of the sampling (the same seed, device and batch size give the same prompts).")
@click.option("--gpu", default=None, type=int, help="CUDA device index; CPU if not given.")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float32"]), default="auto", show_default=True,
              help="auto: bfloat16 on a GPU, float32 on CPU.")
def main(target, out, count, families, holdout, holdout_out, steer, max_new_tokens, answer_tokens, temperature,
         top_k, near_dup, rows, max_tries, exclude, seed, gpu, dtype) -> None:
    """Have the target write COUNT user prompts of several task families and save them as a data set."""
    import torch

    from dflash.runtime.logs import get_logger, setup_logging
    from dflash.runtime.progress import progress
    from dflash.runtime.targets import load_causal_lm, load_tokenizer

    setup_logging("tool", "prompts", gpu=gpu, stream=sys.stderr)  # stdout is the one JSON report
    log = get_logger()
    try:
        weights = parse_families(families)
    except FamilySpecError as e:
        raise click.BadParameter(str(e), param_hint="--families") from None
    for p in exclude:
        try:
            re.compile(p)
        except re.error as e:
            raise click.BadParameter(f"{p!r}: {e}", param_hint="--exclude") from None
    path = Path(out)
    held_path = Path(holdout_out) if holdout_out else holdout_path(path)
    if holdout and held_path.resolve() == path.resolve():
        raise click.BadParameter(f"{held_path} is --out itself", param_hint="--holdout-out")
    wants = split_count(count, weights)  # a --count below the families' number leaves the last ones at 0
    goal = {n: w + holdout for n, w in wants.items() if w + holdout > 0}
    device = torch.device(f"cuda:{gpu}" if gpu is not None else "cpu")
    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(dtype) or (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    log.info("prompts.start", target=target, families=wants, holdout=holdout, steer=steer,
             max_new_tokens=max_new_tokens, temperature=temperature, near_dup=near_dup)
    t0 = time.monotonic()
    tok = load_tokenizer(target)
    model = load_causal_lm(target, dtype=dt).to(device).eval()
    with progress("prompts", total=sum(goal.values()), unit="prompt") as bar:
        def kept(name: str, tallies: dict[str, FamilyTally]) -> None:
            if len(tallies[name].kept) <= goal[name]:
                bar.update()
            bar.note(rejected=sum(sum(t.dropped.values()) for t in tallies.values()))

        decoded = {"requests": 0, "answers": 0}

        def moved(kind: str) -> None:  # the bar moves while candidates and answers decode, not only on a kept row
            decoded["answers" if kind == "answer" else "requests"] += 1
            bar.note(redraw=True, **decoded)

        try:
            writer = PromptWriter(model, tok, steer=steer, max_new_tokens=max_new_tokens, answer_tokens=answer_tokens,
                                  temperature=temperature, top_k=top_k, rows=rows, exclude=list(exclude),
                                  near_dup=near_dup, seed=seed)
            written = writer.write(goal, max_tries=max_tries, on_kept=kept, on_decoded=moved)
        except PromptError as e:
            raise click.ClickException(f"{target}: {e}") from None
    tallies = {n: written.get(n, FamilyTally()) for n in wants}
    train, held, surplus = split_rows(tallies, wants, holdout)
    write_jsonl(path, train, "self")
    if holdout:
        write_jsonl(held_path, held, "holdout")
    counts = family_counts(tallies, train, held)
    rejected: dict[str, int] = {}
    for t in tallies.values():
        for why, n in t.dropped.items():
            rejected[why] = rejected.get(why, 0) + n
    candidates = sum(t.tried for t in tallies.values())
    log.info("prompts.done", out=str(path), holdout_out=str(held_path) if holdout else None, prompts=len(train),
             held_out=len(held), candidates=candidates, rejected=rejected, surplus=surplus, families=counts,
             seconds=round(time.monotonic() - t0, 1))
    click.echo(json.dumps({"out": str(path), "prompts": len(train), "holdout_out": str(held_path) if holdout else None,
                           "holdout": len(held), "candidates": candidates,
                           "usable": sum(len(t.kept) for t in tallies.values()), "surplus": surplus,
                           "rejected": rejected, "families": counts}))


if __name__ == "__main__":
    main()
