"""Prompts written by the target itself, for a user who has no data set (`dflash-prompts`).

    dflash-prompts --target T --count 20000 --out prompts.jsonl [--gpu 0]

An instruction-tuned model given only the opening of a user turn in its chat template
(e.g. `<|im_start|>user\\n`) writes a user request of the kind it was tuned on (the
"Magpie" method). Sampled many times, that is a varied prompt set drawn from what the
target expects to be asked; `dflash-produce --regenerate` then has the target answer each
one. Drafters learn what the target says, so prompts the target finds natural are the ones
worth training on.

Each candidate is kept only if the target ended the turn itself (a turn-end token), it is
not empty, it holds no chat markup, it matches no `--exclude` pattern and it is not a
repeat (case and spacing ignored). Rejections are counted by reason and reported; if the
target cannot write `--count` usable prompts within `--max-tries` candidates, the command
fails instead of writing fewer. Output: chat rows {"id": "self-<n>", "messages": [{"role":
"user", "content": ...}]}, the producer's `--data` format.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import click

_MARK = "\x00DFLASH-USER-TURN\x00"


class PromptError(ValueError):
    """The target or its template cannot write prompts this way."""


def user_turn(tokenizer) -> tuple[str, str]:
    """(the template's text before a user message, the text right after it), from the
    chat template rendered around a marker; a system prompt the template adds by default
    stays in the opening."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("the target's tokenizer has no chat template: it cannot be asked to write a user turn")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
    if text.count(_MARK) != 1:
        raise PromptError("the chat template does not copy a user message verbatim: cannot find where a user turn starts")
    before, after = text.split(_MARK)
    return before, after


def turn_end_ids(tokenizer, after: str, eos: set[int]) -> set[int]:
    """What ends a user turn: the special token the template puts right after the message
    (e.g. <|im_end|>, <|eot_id|>, <end_of_turn>), and the model's end-of-sequence IDs."""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    ends = set(eos)
    if ids and ids[0] in special:
        ends.add(ids[0])
    if not ends:
        raise PromptError("found no token that ends a user turn (no special token after the message, no eos)")
    return ends


@dataclass
class Tally:
    """What happened to every candidate: kept (in order), or why not."""

    usable: list[str] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)

    @property
    def kept(self) -> int:
        return len(self.usable)

    @property
    def tried(self) -> int:
        return self.kept + sum(self.dropped.values())


def judge(text: str, ended: bool, markup: list[str], exclude: list[re.Pattern], seen: set[str]) -> str | None:
    """Why a candidate is rejected, or None to keep it (and remember it in `seen`)."""
    if not ended:
        return "unfinished"  # hit --max-new-tokens before the turn ended: a cut request
    if not text:
        return "empty"
    if any(m in text for m in markup):
        return "markup"  # the model wrote past its turn into the template's tags
    if any(p.search(text) for p in exclude):
        return "excluded"
    key = " ".join(text.lower().split())
    if key in seen:
        return "repeat"
    seen.add(key)
    return None


def write_prompts(model, tokenizer, count: int, *, max_new_tokens: int = 128, temperature: float = 1.0,
                  top_k: int = 0, rows: int = 256, max_tries: int | None = None,
                  exclude: list[str] = (), seed: int = 0) -> tuple[list[str], Tally]:
    """`count` distinct user requests written by `model`; raises PromptError if fewer than
    `count` usable ones come out of `max_tries` candidates (default 4 x count)."""
    import torch

    from dflash.decoding.greedy import GreedyDecoder, Job, Sampler
    from dflash.producers.regenerate import stop_ids

    if count < 1:
        raise PromptError(f"--count {count} must be >= 1")
    before, after = user_turn(tokenizer)
    prompt = tokenizer(before, add_special_tokens=False)["input_ids"]
    ends = turn_end_ids(tokenizer, after, stop_ids(model, tokenizer))
    markup = [t for t in tokenizer.all_special_tokens if len(t) > 1]
    patterns = [re.compile(p, re.IGNORECASE) for p in exclude]
    max_tries = max_tries or 4 * count
    torch.manual_seed(seed)
    dec = GreedyDecoder(model, rows=min(rows, max_tries), max_prompt=len(prompt), max_new_tokens=max_new_tokens,
                        stop_ids=ends, pick=Sampler(temperature, top_k))
    seen: set[str] = set()
    tally = Tally()

    def done(job: Job, out: list[int]) -> None:
        ended = bool(out) and out[-1] in ends
        text = tokenizer.decode(out[:-1] if ended else out, skip_special_tokens=False).strip()
        why = judge(text, ended, markup, patterns, seen)
        if why is None:
            tally.usable.append(text)
        else:
            tally.dropped[why] += 1

    while tally.kept < count and tally.tried < max_tries:
        # Ask for what is still missing, with headroom for rejections, but never past max_tries.
        want = min(max_tries - tally.tried, max(dec.rows, int((count - tally.kept) * 1.25)))
        dec.run(deque(Job(i, prompt) for i in range(want)), done)
    if tally.kept < count:
        raise PromptError(f"the target wrote {tally.kept} usable prompts of the {count} asked for in {tally.tried} "
                          f"candidates (rejected: {dict(tally.dropped)}); raise --max-tries or --max-new-tokens, "
                          "or ask for fewer")
    return tally.usable[:count], tally


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--target", required=True, help="The target: a Hugging Face folder or name, or a .gguf file.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="JSONL file to write (chat rows).")
@click.option("--count", required=True, type=int, help="Distinct prompts to write.")
@click.option("--max-new-tokens", default=128, show_default=True, help="Longest prompt; longer candidates are dropped.")
@click.option("--temperature", default=1.0, show_default=True, help="Sampling temperature.")
@click.option("--top-k", default=0, show_default=True, help="Sample among the k likeliest tokens (0: all).")
@click.option("--batch-size", "rows", default=256, show_default=True, help="Rows decoded at once.")
@click.option("--max-tries", default=None, type=int, help="Candidates to try at most [default: 4 x --count].")
@click.option("--exclude", multiple=True, help="Drop prompts matching this regular expression (case ignored); "
              "repeatable, e.g. to keep an evaluation's task families out of training.")
@click.option("--seed", default=0, show_default=True,
              help="Random seed of the sampling (the same seed, device and batch size give the same prompts).")
@click.option("--gpu", default=None, type=int, help="CUDA device index; CPU if not given.")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float32"]), default="auto", show_default=True,
              help="auto: bfloat16 on a GPU, float32 on CPU.")
def main(target, out, count, max_new_tokens, temperature, top_k, rows, max_tries, exclude, seed, gpu, dtype) -> None:
    """Have the target write COUNT user prompts and save them as a data set."""
    import torch

    from dflash.runtime.logs import setup_logging
    from dflash.runtime.targets import load_causal_lm, load_tokenizer

    setup_logging("tool", "prompts", gpu=gpu, stream=sys.stderr)  # stdout is the one JSON report
    device = torch.device(f"cuda:{gpu}" if gpu is not None else "cpu")
    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(dtype) or (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    for p in exclude:
        try:
            re.compile(p)
        except re.error as e:
            raise click.BadParameter(f"{p!r}: {e}", param_hint="--exclude") from None
    tok = load_tokenizer(target)
    model = load_causal_lm(target, dtype=dt).to(device).eval()
    try:
        texts, tally = write_prompts(model, tok, count, max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_k=top_k, rows=rows, max_tries=max_tries, exclude=list(exclude), seed=seed)
    except PromptError as e:
        raise click.ClickException(f"{target}: {e}") from None
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text("".join(json.dumps({"id": f"self-{i}", "messages": [{"role": "user", "content": t}]}) + "\n"
                           for i, t in enumerate(texts)))
    tmp.replace(path)
    click.echo(json.dumps({"out": str(path), "prompts": len(texts), "candidates": tally.tried,
                           "usable": tally.kept, "rejected": dict(tally.dropped)}))


if __name__ == "__main__":
    main()
