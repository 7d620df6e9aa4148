"""Checks of the batch stager (consumers/training/staging.py) on a real device: a plain script (the GPU
machine has no pytest).

    python bench/gpu_checks.py                # cuda:0 when there is a GPU, else the CPU
    python bench/gpu_checks.py --device cpu   # the CPU path (runs anywhere)

Checks (each `ok` true or false, with its figures):
- staged_equal: bf16 and fp8 batch messages (the real codec, more rows than one fp8 decode
  block) staged on the device equal `Batch.owned` on the CPU, bit for bit, for
  bf16 and float32 features; on CUDA every tensor is on the device (fp8 dequantised there);
- select_micro: skip-held selection and OOM micro-batches of a staged batch (indexed on
  its device) equal those of the CPU batch;
- train_loss: one training step of a small drafter (a tiny target from dflash.tools.tiny)
  on a staged batch has the loss of the same step without staging, to 1e-5 relative
  (bf16 and fp8 messages, through consumers.training.train exactly as dflash-consume runs it);
- no_reuse_race (CUDA): the main stream is made to lag behind, each staged batch is read
  by a kernel queued behind that lag and freed at once, while the stager copies the next
  batches on its own stream; every checksum must be the batch's own (record_stream keeps
  the allocator from handing a block still being read to the stager);
- oom_fallback (CUDA): with the allocator capped, staging runs out of memory; the batch
  comes as the CPU path's, and `train.stage_oom` is logged.
Figures (not pass/fail): `timing`, for a batch of --timing-tokens tokens of 5 x 4096
features: the training thread's wait for the next batch without staging (Batch.owned +
H2D) and with it (after a simulated step), and the stager's own time per batch.

Prints one JSON line {"stage": "gpu_checks", "ok": ..., ...} and exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback

import torch
from structlog.testing import capture_logs

from dflash.protocol.batch import Batch
from dflash.runtime.target_heads import load_target_heads
from dflash.consumers.training.config import TrainConfig
from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig
from dflash.consumers.training.staging import BatchStager
from dflash.protocol.fp8 import FP8_DECODE_ROWS
from dflash.consumers.process.synthetic import as_received, rule_batch
from dflash.consumers.training.step import batch_loss
from dflash.consumers.training.train import train
from dflash.consumers.training.train_config import resolve_signal

LAYERS = [1, 3]
CPU = torch.device("cpu")


# ---------------------------------------------------------------- inputs


def message(b: Batch, fp8: bool) -> Batch:
    """`b` as a consumer receives it: encoded with the codec, decoded to frame views."""
    return as_received(b, fp8, "gpu-checks")


def small_batch(spec, seed: int, n_seqs: int = 4, seq_len: int = 700) -> Batch:
    """A learnable batch (consumers.process.synthetic) of n_seqs x seq_len tokens: 2800 rows by
    default, more than one fp8 decode block."""
    return rule_batch(spec, LAYERS, seed=seed, n_seqs=n_seqs, seq_len=seq_len, batch_id=f"p1-{seed}",
                      sample_start=n_seqs * seed)


def big_message(tokens: int, fp8: bool, seed: int = 0, width: int = 5 * 4096) -> Batch:
    """A batch of `tokens` tokens of a Qwen3-8B capture's width (5 x 4096), 4 sequences."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, width, generator=g, dtype=torch.bfloat16)
    lens = [tokens // 4] * 3 + [tokens - 3 * (tokens // 4)]
    b = Batch.packed([0, 1, 2, 3], lens, torch.randint(0, 1000, (tokens,), generator=g, dtype=torch.int32),
                     torch.ones(tokens, dtype=torch.uint8), hidden, batch_id=f"big-{seed}", layer_ids=[1, 9, 17, 25, 33])
    return message(b, fp8)


def same(a: Batch, b: Batch) -> bool:
    return ((a.batch_id, a.samples, a.seq_lens, a.layer_ids, a.epoch) == (b.batch_id, b.samples, b.seq_lens,
                                                                            b.layer_ids, b.epoch)
            and list(a.tensors) == list(b.tensors)
            and all(x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()) for x, y in zip(a.tensors.values(),
                                                                                         b.tensors.values())))


def staged(items: list, device: torch.device, dtype: torch.dtype) -> list:
    with BatchStager(iter(items), device, dtype) as stager:
        return list(stager)


# ---------------------------------------------------------------- checks


def check_staged_equal(spec, device: torch.device) -> dict:
    src = [small_batch(spec, i) for i in range(2)]
    msgs = [message(src[0], fp8=False), message(src[1], fp8=True)]
    out = {"rows": src[0].tokens, "fp8_decode_rows": FP8_DECODE_ROWS}
    ok = True
    for dtype in (torch.bfloat16, torch.float32):
        got = staged(msgs, device, dtype)
        for name, g, m in (("bf16", got[0], msgs[0]), ("fp8", got[1], msgs[1])):
            on_device = all(t.device.type == device.type for t in g.tensors.values())
            equal = same(g, m.owned(dtype))
            out[f"{name}_as_{str(dtype).split('.')[-1]}"] = {"on_device": on_device, "equal": equal}
            ok = ok and on_device and equal
    return {"ok": ok, **out}


def check_select_micro(spec, device: torch.device) -> dict:
    msg = message(small_batch(spec, 2, n_seqs=5, seq_len=300), fp8=True)
    [g] = staged([msg], device, torch.bfloat16)
    cpu = msg.owned(torch.bfloat16)
    select_ok = same(g.select([0, 2, 4]), cpu.select([0, 2, 4])) and g.select([1]).hidden.device.type == device.type
    parts, cpu_parts = g.split(3), cpu.split(3)
    micro_ok = len(parts) == len(cpu_parts) and all(same(p, q) for p, q in zip(parts, cpu_parts))
    return {"ok": select_ok and micro_ok, "select": select_ok, "micro_batches": micro_ok, "parts": len(parts)}


def first_step_loss(heads, msg, stage: bool) -> float:
    cfg = TrainConfig(draft_layers=2, target_layers=tuple(LAYERS), block_size=4, anchors=16, log_position_every=0,
                      max_steps=1, fuse="off", attn="sdpa", stage_batches=stage)
    with capture_logs() as logs:
        train(cfg, heads, iter([msg]))
    [line] = [e for e in logs if e["event"] == "train.step"]
    return float(line["loss"])


def direct_loss(heads, batch: Batch) -> tuple[float, float]:
    """(loss, gradient norm) of one forward and backward of a fresh drafter (seed 0) on
    `batch`, unrounded, as the loop runs it (bf16 autocast on GPU)."""
    cfg = TrainConfig(draft_layers=2, target_layers=tuple(LAYERS), block_size=4, anchors=16)
    signal = resolve_signal(cfg, heads)
    torch.manual_seed(0)
    model = DFlashDraft(DrafterConfig.from_target(heads.spec, cfg.draft_layers, len(LAYERS))).to(heads.embed.device)
    with torch.autocast(heads.embed.device.type, dtype=torch.bfloat16, enabled=heads.embed.device.type == "cuda"):
        loss_sum, stats = batch_loss(model, heads, batch, signal, seed=0)
    loss_sum.backward()
    grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
    return float(loss_sum) / stats.weight, float(grads.norm())


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def check_train_loss(heads) -> dict:
    """The first step's loss with and without staging: through train() (the logged figure,
    5 decimals) and directly (unrounded, with the gradient norm as a figure)."""
    out, ok = {}, True
    device = heads.embed.device
    for i, fp8 in enumerate((False, True)):
        msg = message(small_batch(heads.spec, 10 + i), fp8=fp8)
        plain, with_stager = first_step_loss(heads, msg, False), first_step_loss(heads, msg, True)
        [staged_batch] = staged([msg], device, heads.embed.dtype)
        d_plain, g_plain = direct_loss(heads, msg.owned(heads.embed.dtype))  # the step copies it
        d_staged, g_staged = direct_loss(heads, staged_batch)
        out["fp8" if fp8 else "bf16"] = {
            "train_loss_unstaged": plain, "train_loss_staged": with_stager, "train_rel_diff": rel(with_stager, plain),
            "loss_unstaged": d_plain, "loss_staged": d_staged, "rel_diff": rel(d_staged, d_plain),
            "grad_norm_unstaged": g_plain, "grad_norm_staged": g_staged}
        ok = ok and rel(with_stager, plain) <= 1e-5 and rel(d_staged, d_plain) <= 1e-5
    return {"ok": ok, **out}


def gpu_sleep(device: torch.device, ms: float) -> None:
    """Keep the current stream busy for about `ms` (the host returns at once)."""
    torch.cuda._sleep(int(ms * _cycles_per_ms(device)))


def _cycles_per_ms(device: torch.device, _cache: dict = {}) -> float:  # noqa: B006 (a cache on purpose)
    if device not in _cache:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _cache[device] = 10_000_000 / start.elapsed_time(end)
    return _cache[device]


def check_no_reuse_race(device: torch.device, n: int = 8, tokens: int = 1600) -> dict:
    msgs = [big_message(tokens, fp8=False, seed=i) for i in range(n)]
    want = [int(m.tensors["hidden"].view(torch.int16).sum(dtype=torch.int64)) for m in msgs]
    sums = []
    with BatchStager(iter(msgs), device, torch.bfloat16) as stager:
        for _ in range(n):
            b = next(stager)
            gpu_sleep(device, 40)  # the main stream now runs behind the host
            sums.append(b.hidden.view(torch.int16).sum(dtype=torch.int64))  # queued behind the sleep
            del b  # freed while its checksum is still queued: the stager may copy the next batches now
            time.sleep(0.01)
    torch.cuda.synchronize(device)
    got = [int(s) for s in sums]
    return {"ok": got == want, "batches": n, "mib_each": round(msgs[0].payload_bytes() / 2**20, 1),
            "wrong": [i for i, (x, y) in enumerate(zip(got, want)) if x != y]}


def check_oom_fallback(device: torch.device) -> dict:
    msg = big_message(1600, fp8=False, seed=99)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    cap = torch.cuda.memory_reserved(device) + 16 * 2**20  # 16 MiB of room for a 64 MiB batch
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    try:
        with capture_logs() as logs:
            [b] = staged([msg], device, torch.bfloat16)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    logged = [e for e in logs if e["event"] == "train.stage_oom"]
    on_cpu = all(t.device.type == "cpu" for t in b.tensors.values())
    equal = same(b, msg.owned(torch.bfloat16))
    return {"ok": on_cpu and equal and len(logged) == 1, "on_cpu": on_cpu, "equal": equal,
            "logged": [{k: e.get(k) for k in ("batch_id", "tokens", "error")} for e in logged]}


# ---------------------------------------------------------------- figures


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timing(device: torch.device, tokens: int, step_s: float = 1.0, reps: int = 3) -> dict:
    """Milliseconds the training thread waits for its next batch, per encoding."""
    out = {"tokens": tokens, "width": 5 * 4096}
    for fp8 in (False, True):
        msg = big_message(tokens, fp8)
        unstaged = []
        for _ in range(reps):  # what the loop did before: owned(), then the step's H2D copy
            t0 = time.perf_counter()
            b = msg.owned(torch.bfloat16)
            b.hidden.to(device, non_blocking=True)
            sync(device)
            unstaged.append(time.perf_counter() - t0)
            del b
        waits, stage_s = [], []
        with BatchStager(iter([msg] * (reps + 1)), device, torch.bfloat16) as stager:
            next(stager)  # the first batch is not overlapped with anything
            for _ in range(reps):
                time.sleep(step_s)  # a step: the stager prepares the next batch meanwhile
                t0 = time.perf_counter()
                next(stager)
                waits.append(time.perf_counter() - t0)
        t0 = time.perf_counter()  # the stager's own work for one batch (with its thread's start)
        staged([msg], device, torch.bfloat16)
        stage_s.append(time.perf_counter() - t0)
        out["fp8" if fp8 else "bf16"] = {
            "mib": round(msg.payload_bytes() / 2**20, 1),
            "unstaged_wait_ms": round(1e3 * sorted(unstaged)[len(unstaged) // 2], 2),
            "staged_wait_ms": round(1e3 * sorted(waits)[len(waits) // 2], 2),
            "stager_ms_per_batch": round(1e3 * stage_s[0], 2)}
        del msg
    return out


# ---------------------------------------------------------------- main


def run_check(results: dict, name: str, fn, *args) -> None:
    try:
        results[name] = fn(*args)
    except Exception as e:  # a check that crashes fails; the others still run
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda, cuda:N or cpu (default: cuda when there is one)")
    ap.add_argument("--timing-tokens", type=int, default=None,
                    help="tokens of the timed batch (default 12288 on CUDA, 1024 on CPU; 0: no timing)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(json.dumps({"stage": "gpu_checks", "ok": False, "error": "--device cuda but no CUDA device"}))
            return 1
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    from dflash.tools.tiny import tiny_target

    with tempfile.TemporaryDirectory() as tmp:
        heads = load_target_heads(tiny_target(tmp), device=device,
                                  dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        checks: dict = {}
        run_check(checks, "staged_equal", check_staged_equal, heads.spec, device)
        run_check(checks, "select_micro", check_select_micro, heads.spec, device)
        run_check(checks, "train_loss", check_train_loss, heads)
        if device.type == "cuda":
            run_check(checks, "no_reuse_race", check_no_reuse_race, device)
            run_check(checks, "oom_fallback", check_oom_fallback, device)
    tokens = args.timing_tokens if args.timing_tokens is not None else (12288 if device.type == "cuda" else 1024)
    figures: dict = {}
    if tokens:
        run_check(figures, "timing", timing, device, tokens)
    ok = all(c["ok"] for c in checks.values())
    print(json.dumps({"stage": "gpu_checks", "ok": ok, "device": str(device),
                      "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                      "torch": torch.__version__, "checks": checks, **figures}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
