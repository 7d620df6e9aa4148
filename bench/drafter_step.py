"""Drafter-only step throughput and memory on one GPU, without producers or a real target.

    python bench/drafter_step.py --gpu 0 --seqs 4 --seq-len 3072 --steps 12
    python bench/drafter_step.py --shape smollm2-135m --seqs 16 --seq-len 290 --vary [--profile 4]

Builds a target folder shaped like Qwen3-8B (config.json plus random embed_tokens and
lm_head, nothing else: that is all a consumer reads), then trains on the synthetic
stream through the same loop as dflash-consume and prints one JSON summary line: step
time, tokens/s, samples/s, peak memory, first and last loss (with --profile, kernels and
host synchronisations per step too: time the steps without it, the profiler slows them).
Also checks that the flex and SDPA attention paths agree in bf16 on a small batch.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import click
import torch
from safetensors.torch import save_file
from structlog.testing import capture_logs

from dflash.runtime.gpu import matmul_ceiling_tflops

from dflash.consumers.drafter.blocks import build_layout
from dflash.consumers.training.flops import step_flops, step_shape
from dflash.consumers.drafter.model import DrafterConfig
from dflash.consumers.training.step import draft_states, make_layout
from dflash.consumers.process.synthetic import rule_batch, synthetic_stream
from dflash.runtime.target_heads import load_target_heads
from dflash.consumers.training.train import train
from dflash.consumers.training.train_config import Hooks, resolve_signal
from dflash.consumers.training.config import TrainConfig

QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 36, "vocab_size": 151936,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
            "tie_word_embeddings": False}


# SmolLM2-135M-Instruct's shape: a small target, where a step's fixed costs show.
SMOLLM2_135M = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "num_hidden_layers": 30, "vocab_size": 49152,
                "rms_norm_eps": 1e-5, "rope_theta": 100000, "max_position_embeddings": 8192,
                "tie_word_embeddings": True}
SHAPES = {"qwen3-8b": QWEN3_8B, "smollm2-135m": SMOLLM2_135M}


def _stage(name: str, t0: float) -> None:
    """Progress as it happens: a slow stage (compilation, disk) shows where it is stuck."""
    print(json.dumps({"stage": name, "t_s": round(time.monotonic() - t0, 1)}), flush=True)


def fake_target(folder: Path, cfg: dict = QWEN3_8B) -> Path:
    """config.json + model.safetensors holding only the two head tensors (random bf16)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    V, D = cfg["vocab_size"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(0)
    save_file({"model.embed_tokens.weight": (torch.randn(V, D, generator=g) * 0.02).bfloat16(),
               "lm_head.weight": (torch.randn(V, D, generator=g) * 0.05).bfloat16()}, folder / "model.safetensors")
    return folder


def check_flex_vs_sdpa(heads, cfg: TrainConfig) -> tuple[float, float]:
    """Max |flex - sdpa| / max |sdpa| of the drafter's states on a small packed batch, and the
    largest such figure over the parameters' gradients (flex pads its context keys; SDPA does not)."""
    from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig

    signal = resolve_signal(cfg, heads)
    torch.manual_seed(0)
    model = DFlashDraft(DrafterConfig.from_target(heads.spec, cfg.draft_layers, len(signal.target_layers)))
    model = model.to(heads.embed.device)
    batch = rule_batch(heads.spec, list(signal.target_layers), seed=1, n_seqs=3, seq_len=300, dtype=torch.bfloat16)
    layout = make_layout(batch, signal, 0, heads.embed.device, "sdpa")
    out, grads = {}, {}
    for be in ("sdpa", "flex"):
        model.zero_grad(set_to_none=True)
        with torch.autocast(heads.embed.device.type, dtype=torch.bfloat16):
            lay = build_layout(batch.seq_lens, layout.anchors, signal.block_size, heads.embed.device, be)
            out[be] = draft_states(model, heads, batch, lay, signal).float()
        weights = torch.randn(out[be].shape, generator=torch.Generator().manual_seed(2)).to(out[be].device)
        (out[be] * weights).sum().backward()
        grads[be] = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    rel = float((out["flex"] - out["sdpa"]).detach().abs().max() / out["sdpa"].detach().abs().max())
    grad_rel = max(float((grads["flex"][n] - g).abs().max() / g.abs().max().clamp_min(1e-12))
                   for n, g in grads["sdpa"].items())
    return rel, grad_rel


def use_torch_block_mask() -> None:
    """Replace the tile-bounds block mask with torch's create_block_mask of the same rule."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash.consumers.drafter import blocks

    def element_wise(layout, device):
        K, Q = layout.context_keys, layout.num_queries
        return create_block_mask(blocks._mask_mod(layout, device), None, None, Q, K + Q, device=device,
                                 _compile=device.type == "cuda")

    blocks._flex_block_mask = element_wise


_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _profile_table(prof, n_steps: int, wall_s: float) -> dict:
    """Per step: GPU busy time against wall time, kernels and host synchronisations (the
    training thread's and the stager's; the bench's own sync at the window's end is one),
    and the top kernels and host ops."""
    ev = prof.key_averages()
    kernels = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e3 / n_steps
    syncs = {e.key: e.count for e in ev if e.key in _SYNC_CALLS}
    figures = {"profile_steps": n_steps, "wall_ms_per_step": round(1e3 * wall_s / n_steps, 2),
               "gpu_busy_ms_per_step": round(busy, 2),
               "kernels_per_step": round(sum(e.count for e in kernels) / n_steps),
               "syncs_per_step": round(sum(syncs.values()) / n_steps, 2), "sync_calls": syncs}
    print(json.dumps(figures), flush=True)
    print(ev.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60), flush=True)
    print(ev.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60), flush=True)
    return figures


@click.command()
@click.option("--gpu", default=0, type=int, help="CUDA device index.")
@click.option("--seqs", default=4, type=int, help="Sequences per batch.")
@click.option("--seq-len", default=3072, type=int, help="Tokens per sequence.")
@click.option("--steps", default=12, type=int, help="Steps to run (the first ones include compilation).")
@click.option("--anchors", default=512, type=int, help="Anchors per sequence.")
@click.option("--block-size", default=16, type=int, help="Block size.")
@click.option("--attn", default="auto", type=click.Choice(["auto", "flex", "sdpa"]),
              help="Attention kernel (auto: as dflash-consume, flex where it compiles).")
@click.option("--loss-chunk", default=2048, type=int, help="Block positions per logits chunk.")
@click.option("--vary", is_flag=True, help="Vary sequence lengths from batch to batch, as real packing does.")
@click.option("--shape", default="qwen3-8b", type=click.Choice(sorted(SHAPES)), help="Shape of the fake target.")
@click.option("--vocab", default=None, type=int, help="Vocabulary of the fake target (default: the shape's).")
@click.option("--profile", "--profile-steps", "profile_steps", default=0, type=int,
              help="Profile this many steps after the first half (torch.profiler): kernels and host syncs a step "
                   "(also in the summary line), top kernels and host ops.")
@click.option("--skip-check", is_flag=True, help="Skip the flex-vs-SDPA agreement check.")
@click.option("--draft-layers", default=5, type=int, help="Draft decoder layers.")
@click.option("--fuse", default="auto", type=click.Choice(["auto", "on", "off"]), help="As dflash-consume --fuse.")
@click.option("--torch-block-mask", is_flag=True,
              help="Build flex block masks with torch's create_block_mask (the element-wise pass), for a before/after.")
@click.option("--ceiling-tflops", default=None, type=float,
              help="bf16 matmul rate for MFU (default: measured on this GPU first).")
def main(gpu, seqs, seq_len, steps, anchors, block_size, attn, loss_chunk, vary, shape, vocab, profile_steps,
         skip_check, draft_layers, torch_block_mask, ceiling_tflops, fuse) -> None:
    """Measure drafter training steps on synthetic batches shaped like real ones."""
    if torch_block_mask:
        use_torch_block_mask()
    device = torch.device("cuda", gpu)
    torch.cuda.set_device(device)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        vocab = vocab or SHAPES[shape]["vocab_size"]
        target = fake_target(Path(tmp) / "target", {**SHAPES[shape], "vocab_size": vocab})
        _stage("fake_target_written", start)
        heads = load_target_heads(target, device=device, dtype=torch.bfloat16)
    _stage("heads_loaded", start)
    mask_id = 151669 if vocab > 151669 else vocab - 1
    cfg = TrainConfig(block_size=block_size, anchors=anchors, anchor_every=1, attn=attn, loss_chunk=loss_chunk, lr=6e-4,
                      total_steps=steps, log_position_every=0, mask_token_id=mask_id, draft_layers=draft_layers,
                      fuse=fuse)
    ceiling = ceiling_tflops or matmul_ceiling_tflops(device)
    rel, grad_rel = (None, None) if skip_check else check_flex_vs_sdpa(heads, cfg)
    _stage("flex_vs_sdpa_checked", start)
    signal = resolve_signal(cfg, heads)
    # Made up front: the generator is not what is measured (real batches arrive ready).
    layers = list(signal.target_layers)
    if vary:  # a new T and Q every batch, never seen before: what compiled kernels must cope with
        batches = [rule_batch(heads.spec, layers, seed=i, n_seqs=seqs, seq_len=seq_len - (41 * i) % max(1, seq_len // 2),
                              sample_start=i * seqs, dtype=torch.bfloat16) for i in range(steps)]
    else:
        batches = list(synthetic_stream(heads.spec, layers, batches=steps, n_seqs=seqs, seq_len=seq_len))
    _stage("batches_made", start)
    torch.cuda.reset_peak_memory_stats(device)
    ends: list[float] = []
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.CUDA]) if profile_steps else None
    half = steps // 2  # the first steps compile kernels: timed from the end of step half + 1
    profiled: dict = {}

    def after_step(step, model):
        # Waits for the GPU only where a time is taken (the first step, the timed window's
        # ends): a wait every step would keep the host from queueing the next step early.
        timed = step in (1, half + 1, steps) or (prof is not None and step in (half, half + profile_steps))
        if timed:
            torch.cuda.synchronize(device)
        ends.append(time.monotonic())
        _stage(f"step_{step}", start)
        if prof is not None and step == half:
            prof.start()
        if prof is not None and step == half + profile_steps:
            prof.stop()
            profiled.update(_profile_table(prof, profile_steps, ends[-1] - ends[-1 - profile_steps]))

    t0 = time.monotonic()
    with capture_logs() as logs:
        train(replace(cfg), heads, batches, hooks=Hooks(after_step=after_step))
    torch.cuda.synchronize(device)
    wall = time.monotonic() - t0
    lines = [e for e in logs if e["event"] == "train.step"]
    if len(ends) != steps:
        raise SystemExit(f"{len(ends)} steps ran, not {steps}: see the log above")
    step_s = (ends[-1] - ends[half]) / max(1, len(ends) - 1 - half)
    dcfg = DrafterConfig.from_target(heads.spec, cfg.draft_layers, len(layers))
    timed = batches[half + 1 : len(ends)]
    shapes = [step_shape(b, block_size, anchors, cfg.seed) for b in timed]
    flops_per_step = sum(step_flops(dcfg, heads.spec.vocab_size, s) for s in shapes) / max(1, len(shapes))
    anchors_per_step = sum(s.queries for s in shapes) / block_size / max(1, len(shapes))
    print(json.dumps({
        "attn": attn, "backend": next(e["attn"] for e in logs if e["event"] == "train.start"), "fuse": fuse,
        "block_mask": "torch" if torch_block_mask else "tiles", "vary": vary,
        "seqs": seqs, "seq_len": seq_len, "anchors": anchors, "block_size": block_size,
        "queries_per_batch": seqs * anchors * block_size, "steps": len(lines), "wall_s": round(wall, 1),
        "first_step_s": round(ends[0] - t0, 2), "step_s": round(step_s, 3),
        "tokens_per_s": round(sum(b.tokens for b in timed) / max(1, len(timed)) / step_s),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
        "loss_first": lines[0]["loss"], "loss_last": lines[-1]["loss"], "acc_last": lines[-1]["acc"],
        "flex_vs_sdpa_rel_err": rel, "flex_vs_sdpa_grad_rel_err": grad_rel, "tflop_per_step": round(flops_per_step / 1e12, 2),
        "achieved_tflops": round(flops_per_step / step_s / 1e12, 1), "ceiling_tflops": round(ceiling, 1),
        "mfu": round(flops_per_step / step_s / 1e12 / ceiling, 3),
        "anchors_per_s": round(anchors_per_step / step_s),
        "samples_per_s": round(sum(len(b.samples) for b in timed) / max(1, len(timed)) / step_s, 1),
        "gpu": torch.cuda.get_device_name(device),
        **{k: profiled[k] for k in ("kernels_per_step", "syncs_per_step", "gpu_busy_ms_per_step") if k in profiled},
    }))


if __name__ == "__main__":
    main()
