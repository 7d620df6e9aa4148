"""Benchmark: layer capture vs the naive `output_hidden_states=True` + logits forward pass.

    python bench/capture_gpu.py --shape qwen3-8b --tokens 8192,16384 --attn sdpa
    python bench/capture_gpu.py --target DIR --data chats.jsonl --token-budget 49152 --attn flex_attention

With `--target` and `--data`, the model is loaded from DIR (`from_pretrained`) and the
batches are the producer's own: the dataset's rows through the chat template, truncation
and first-fit packing to `--token-budget`, in the dry-run's order; every pass is timed
once after one warm-up batch, and the rate is tokens over time for all of them.

A randomly initialised model of a real target's shape is built on the GPU (no download:
speed and memory do not depend on the weights' values). For each token count it reports
peak GPU memory above the weights and time per pass for: the naive pass, capture with the
full model, and capture with the tail layers and LM head dropped (what the producer runs).
It also checks packed == per-sequence in the model dtype. One JSON object per line; with
`--ceiling-tflops` (or a measured bf16 matmul rate) each row has its MFU: forward FLOPs of
the layers run (2 x params x tokens, plus causal attention within each packed sequence)
over time, against that ceiling.
"""

from __future__ import annotations

import json
import time

import click
import torch

from dflash.producers.packing import check_packing
from dflash.protocol.batch import position_ids
from dflash.producers.target import Target
from dflash.runtime.targets import default_layer_ids

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


def forward_flops(cfg, layers_run: int, seq_lens: list[int], logits: bool) -> int:
    """Matrix FLOPs of a forward pass over `layers_run` decoder layers (and the LM head)."""
    D, hd = cfg.hidden_size, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    Hq, Hkv, Dff = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    T = sum(seq_lens)
    per_layer = 2 * T * (2 * D * Hq * hd + 2 * D * Hkv * hd + 3 * D * Dff)
    per_layer += 4 * hd * Hq * sum(L * (L + 1) // 2 for L in seq_lens)  # causal: keys <= own position
    return layers_run * per_layer + (2 * T * D * cfg.vocab_size if logits else 0)


def _real_batches(target_dir: str, data: str, budget: int, max_length: int, max_batch: int, n: int):
    """The producer's first `n` batches of `data`: (input_ids, position_ids, seq_lens) on the GPU."""
    from transformers import AutoTokenizer

    from dflash.producers.chat import ChatEncoder
    from dflash.producers.data import open_dataset
    from dflash.producers.packing import pack

    ds, enc = open_dataset(data), ChatEncoder(AutoTokenizer.from_pretrained(target_dir), max_length)
    out, row, lease = [], 0, 256
    while len(out) < n and row < len(ds):
        seqs = [enc.encode(ds.read(i)) for i in range(row, min(row + lease, len(ds)))]
        for pb in pack(seqs, budget, max_batch):
            out.append((pb.input_ids.long().cuda(), pb.position_ids().cuda(), list(pb.seq_lens)))
        row += lease
    return out[:n]


def _measure_batches(fn, batches) -> tuple[float, int, int]:
    """(seconds for all batches after one warm-up pass, tokens, peak bytes above the start)."""
    fn(*batches[0][:2])
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for ids, pos, _ in batches[1:]:
        out = fn(ids, pos)
        del out
    torch.cuda.synchronize()
    return time.perf_counter() - t0, sum(ids.numel() for ids, _, _ in batches[1:]), torch.cuda.max_memory_allocated() - base


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
@click.option("--target", "target_dir", default=None, help="Load this target folder instead of a random --shape.")
@click.option("--data", default=None, help="With --target: measure on the producer's packed batches of this dataset.")
@click.option("--token-budget", default=49152, help="With --data: tokens per packed batch.")
@click.option("--max-length", default=3072, help="With --data: truncation length.")
@click.option("--max-batch-size", default=64, help="With --data: sequences per batch.")
@click.option("--batches", default=12, help="With --data: batches timed (after one warm-up).")
@click.option("--ceiling-tflops", default=None, type=float, help="bf16 matmul rate for MFU (default: measured).")
def main(shape: str, tokens: str, seq_len: int, attn: str, reps: int, skip_naive: bool, dtype: str,
         vary: int, vary_min: int, target_dir, data, token_budget, max_length, max_batch_size, batches,
         ceiling_tflops) -> None:
    """Peak memory and time of capture vs naive forward on a random model of a real shape."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash.runtime.gpu import matmul_ceiling_tflops

    ceiling = ceiling_tflops or matmul_ceiling_tflops(torch.device("cuda"))
    if data:
        return _real_data(target_dir, data, attn, token_budget, max_length, max_batch_size, batches, skip_naive,
                          ceiling)

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
    full = model = None  # freed before the trimmed runs (the lambdas above are done with them)
    torch.cuda.empty_cache()
    for T in counts:
        lens = [seq_len] * (T // seq_len) + ([T % seq_len] if T % seq_len else [])
        ids = torch.randint(0, cfg.vocab_size, (T,), device="cuda")
        pos = position_ids(lens).cuda()
        results[("capture_trimmed", T)] = _measure(lambda: trimmed.capture(ids, pos), reps)
    kept = max(layer_ids) + 1
    for (mode, T), (sec, peak) in results.items():
        lens = [seq_len] * (T // seq_len) + ([T % seq_len] if T % seq_len else [])
        fl = forward_flops(cfg, cfg.num_hidden_layers if mode == "naive" else kept, lens, mode == "naive")
        _emit(shape=shape, attn=attn, mode=mode, tokens=T, ms=round(sec * 1e3, 1),
              tokens_per_s=round(T / sec), peak_gib=round(peak / 2**30, 3),
              mfu=round(fl / sec / 1e12 / ceiling, 3), ceiling_tflops=round(ceiling, 1))
    if vary:
        _vary(trimmed, cfg.vocab_size, vary_min or max(counts) // 2, max(counts), seq_len, vary, attn)


def _real_data(target_dir, data, attn, budget, max_length, max_batch, n, skip_naive, ceiling) -> None:
    """Naive pass vs the producer's capture on the producer's own packed batches of `data`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16, attn_implementation=attn,
                                                 device_map={"": "cuda"})
    model.eval().requires_grad_(False)
    cfg = model.config
    layer_ids = default_layer_ids(cfg.num_hidden_layers)
    work = _real_batches(target_dir, data, budget, max_length, max_batch, n + 1)
    lens = [L for _, _, s in work[1:] for L in s]
    _emit(mode="data", batches=len(work) - 1, tokens=sum(lens), seqs=len(lens), mean_seq=round(sum(lens) / len(lens)),
          tokens_per_batch=round(sum(lens) / (len(work) - 1)), weights_gib=round(torch.cuda.memory_allocated() / 2**30, 2))
    rows = []
    if not skip_naive:
        rows.append(("naive", cfg.num_hidden_layers, True, torch.cuda.memory_allocated(),
                     _measure_batches(lambda i, p: _naive(model, i, p, layer_ids), work)))
    trimmed = Target(model, "bench", layer_ids)
    model = None  # only the trimmed target from here (the lambda above is done with it)
    torch.cuda.empty_cache()
    rows.append(("capture_trimmed", max(layer_ids) + 1, False, torch.cuda.memory_allocated(),
                 _measure_batches(trimmed.capture, work)))
    for mode, layers_run, logits, weights, (sec, T, peak) in rows:
        fl = sum(forward_flops(cfg, layers_run, s, logits) for _, _, s in work[1:])
        _emit(mode=mode, attn=attn, data=data, tokens=T, s=round(sec, 3), tokens_per_s=round(T / sec),
              peak_above_weights_gib=round(peak / 2**30, 2), weights_gib=round(weights / 2**30, 2),
              peak_total_gib=round((peak + weights) / 2**30, 2), mfu=round(fl / sec / 1e12 / ceiling, 3),
              ceiling_tflops=round(ceiling, 1))


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
