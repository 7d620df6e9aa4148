"""Inputs of the GPU benchmarks, built on the GPU machine (nothing is downloaded).

    python bench/gpu_setup.py target --shape qwen3-8b --out /tmp/dflash-gpu/qwen3-8b
    python bench/gpu_setup.py data --tokenizer /tmp/dflash-gpu/qwen3-8b --out chats.jsonl --n 3000 --median 900

`target`: a randomly initialised model of a real target's shape (bf16, `save_pretrained`),
with the tiny tokenizer and chat template of `dflash.tools.tiny`, so the producer loads it
through exactly the path of a real checkpoint. Speed and memory do not depend on the
weights' values; the vocabulary rows beyond the tokenizer's are simply never read.

`data`: chat JSONL rows whose token lengths (under that tokenizer and template) follow a
chat-SFT-like distribution: a short user turn and an assistant turn whose length is drawn
from a log-normal (`--median`, `--sigma`), clipped to [`--min`, `--max`]. The text is the
bundled sample chats' assistant text, repeated; what the producer does with it (template,
loss mask, truncation, packing) is the real path. `--median 100000` with `--min 3072`
gives rows that all reach the truncation length (uniform batches).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import click

SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
}


@click.group()
def main() -> None:
    """Build the GPU benchmarks' target and data."""


@main.command()
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default="qwen3-8b", help="Target shape.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder to write (kept if present).")
def target(shape: str, out: str) -> None:
    """A random bf16 target of SHAPE with the tiny tokenizer, saved like a checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    from dflash.tools.tiny import tiny_target

    folder = Path(out)
    if (folder / "config.json").exists():
        click.echo(json.dumps({"target": str(folder), "built": False}))
        return
    tok = AutoTokenizer.from_pretrained(tiny_target(family="qwen3"))
    cfg = Qwen3Config(**SHAPES[shape], tie_word_embeddings=False, max_position_embeddings=40960,
                      rope_theta=1_000_000, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp, max_shard_size="4GB")
    tok.save_pretrained(tmp)
    tmp.rename(folder)
    click.echo(json.dumps({"target": str(folder), "built": True, "params": sum(p.numel() for p in model.parameters())}))


@main.command()
@click.option("--tokenizer", required=True, help="Folder with the tokenizer (a target folder).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="JSONL file to write.")
@click.option("--n", default=3000, help="Rows.")
@click.option("--median", default=900.0, help="Median assistant length, tokens.")
@click.option("--sigma", default=0.8, help="Log-normal sigma of the length.")
@click.option("--min", "min_len", default=64, help="Shortest assistant turn, tokens.")
@click.option("--max", "max_len", default=3072, help="Longest assistant turn, tokens (the producer truncates anyway).")
@click.option("--seed", default=0, help="Seed of the lengths and texts.")
def data(tokenizer: str, out: str, n: int, median: float, sigma: float, min_len: int, max_len: int, seed: int) -> None:
    """Chat rows with log-normal assistant lengths (see the module docstring)."""
    from transformers import AutoTokenizer

    from dflash.producers.sample_data import generate_chats

    tok = AutoTokenizer.from_pretrained(tokenizer)
    chats = generate_chats()
    answers = [m["content"] for c in chats for m in c["messages"] if m["role"] == "assistant"]
    questions = [m["content"] for c in chats for m in c["messages"] if m["role"] == "user"]
    corpus = " ".join(answers)
    chars_per_token = len(corpus) / len(tok(corpus)["input_ids"])
    rng = random.Random(seed)
    lengths = []
    with open(out, "w") as f:
        for i in range(n):
            tokens = int(min(max_len, max(min_len, rng.lognormvariate(math.log(median), sigma))))
            start = rng.randrange(len(corpus))
            text = (corpus[start:] + " " + corpus)[: int(tokens * chars_per_token)]
            f.write(json.dumps({"messages": [{"role": "user", "content": rng.choice(questions)},
                                             {"role": "assistant", "content": text}]}) + "\n")
            lengths.append(tokens)
    lengths.sort()
    click.echo(json.dumps({"data": out, "rows": n, "chars_per_token": round(chars_per_token, 2),
                           "assistant_tokens_median": lengths[n // 2], "assistant_tokens_mean": round(sum(lengths) / n),
                           "assistant_tokens_p90": lengths[int(n * 0.9)]}))


if __name__ == "__main__":
    main()
