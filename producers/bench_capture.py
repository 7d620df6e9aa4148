"""Benchmark: layer capture vs the naive `output_hidden_states=True` + logits forward pass.

    python -m dflash.producers.bench_capture --shape qwen3-8b --tokens 8192,16384 --attn sdpa

A randomly initialised model of a real target's shape is built on the GPU (no download:
speed and memory do not depend on the weights' values). For each token count it reports
peak GPU memory above the weights and time per pass for: the naive pass, capture with the
full model, and capture with the tail layers and LM head dropped (what the producer runs).
It also checks packed == per-sequence in the model dtype. One JSON object per line.
"""

from __future__ import annotations

import json
import time

import click
import torch

from .packing import check_packing, position_ids
from .target import Target, default_layer_ids

SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
}


def _measure(fn, reps: int) -> tuple[float, int]:
    """(seconds per pass, peak bytes allocated above what was allocated before)."""
    fn()  # warm-up (kernels, allocator)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn()
        del out
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps, torch.cuda.max_memory_allocated() - base


def _naive(model, ids, pos, layer_ids):
    with torch.inference_mode():
        out = model(input_ids=ids[None], position_ids=pos[None], output_hidden_states=True, use_cache=False)
        return torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], -1), out.logits


def _emit(**row) -> None:
    click.echo(json.dumps(row))


@click.command()
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default="qwen3-8b", help="Target shape.")
@click.option("--tokens", default="8192,16384", help="Comma-separated tokens per pass.")
@click.option("--seq-len", default=2048, help="Length of each packed sequence.")
@click.option("--attn", default="sdpa", help="Attention implementation.")
@click.option("--reps", default=3, help="Timed passes per setting.")
@click.option("--skip-naive", is_flag=True, help="Only the producer's capture (large token counts).")
@click.option("--vary", default=0, help="Then N passes of random sizes in [--vary-min, T] (recompilation check).")
@click.option("--vary-min", default=0, help="Smallest size of a --vary pass (default T/2).")
@click.option("--dtype", default="bfloat16", type=click.Choice(["bfloat16", "float32"]), help="Model dtype.")
def main(shape: str, tokens: str, seq_len: int, attn: str, reps: int, skip_naive: bool, dtype: str,
         vary: int, vary_min: int) -> None:
    """Peak memory and time of capture vs naive forward on a random model of a real shape."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(**SHAPES[shape], tie_word_embeddings=False, max_position_embeddings=65536)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype), attn_implementation=attn)
    model.eval().requires_grad_(False)
    layer_ids = default_layer_ids(cfg.num_hidden_layers)
    counts = [int(t) for t in tokens.split(",")]
    full = Target(model, shape, layer_ids, full=True)
    err, leak = check_packing(full.capture, cfg.vocab_size, lens=(700, 1300, 400))
    _emit(shape=shape, attn=attn, dtype=dtype, layer_ids=layer_ids, packing_rel_err=err, leak_rel_err=leak,
          weights_gib=round(torch.cuda.memory_allocated() / 2**30, 2))
    results = {}
    for T in counts:
        lens = [seq_len] * (T // seq_len) + ([T % seq_len] if T % seq_len else [])
        ids = torch.randint(0, cfg.vocab_size, (T,), device="cuda")
        pos = position_ids(lens).cuda()
        if not skip_naive:
            results[("naive", T)] = _measure(lambda: _naive(model, ids, pos, layer_ids), reps)
        results[("capture_full_model", T)] = _measure(lambda: full.capture(ids, pos), reps)
    trimmed = Target(model, shape, layer_ids)  # drops layers after the last wanted one
    del full, model
    torch.cuda.empty_cache()
    for T in counts:
        lens = [seq_len] * (T // seq_len) + ([T % seq_len] if T % seq_len else [])
        ids = torch.randint(0, cfg.vocab_size, (T,), device="cuda")
        pos = position_ids(lens).cuda()
        results[("capture_trimmed", T)] = _measure(lambda: trimmed.capture(ids, pos), reps)
    for (mode, T), (sec, peak) in results.items():
        _emit(shape=shape, attn=attn, mode=mode, tokens=T, ms=round(sec * 1e3, 1),
              tokens_per_s=round(T / sec), peak_gib=round(peak / 2**30, 3))
    if vary:
        _vary(trimmed, cfg.vocab_size, vary_min or max(counts) // 2, max(counts), seq_len, vary, attn)


def _vary(target: Target, vocab: int, lo: int, T: int, seq_len: int, n: int, attn: str) -> None:
    """Passes of changing size and sequence mix, as in production: any recompilation or
    allocator churn shows as slow passes after the first."""
    g = torch.Generator().manual_seed(1)
    times, sizes = [], []
    for _ in range(n):
        lens, left = [], int(torch.randint(T // 2, T + 1, (1,), generator=g))
        while left > 0:
            lens.append(min(left, int(torch.randint(seq_len // 4, seq_len + 1, (1,), generator=g))))
            left -= lens[-1]
        ids = torch.randint(0, vocab, (sum(lens),), device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        target.capture(ids, position_ids(lens).cuda())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        sizes.append(sum(lens))
    slow = [(sizes[i], round(t * 1e3)) for i, t in enumerate(times) if t > 3 * sorted(times)[n // 2]]
    _emit(attn=attn, mode="vary", passes=n, slow_passes=slow, first_ms=[round(t * 1e3) for t in times[:3]],
          median_ms=round(sorted(times)[n // 2] * 1e3), tokens_per_s=round(sum(sizes) / sum(times)),
          tokens_per_s_after_3=round(sum(sizes[3:]) / sum(times[3:])) if n > 3 else None)


if __name__ == "__main__":
    main()
