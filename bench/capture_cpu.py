"""Capture vs the naive forward pass on CPU, with a small model whose LM head matters.

    python bench/capture_cpu.py                          # ~1-2 min on 2 cores
    python bench/capture_cpu.py --tokens 1024 --threads 2

The producer's capture (producers.target.Target: the wanted layers only, written by hooks
into one [T, n*H] buffer, forward stopped after the last wanted layer, layers after it and
the LM head dropped) against the naive pass (`output_hidden_states=True` + logits, then a
cat of the wanted layers) on the same packed batch (several sequences, positions restart
at 0: varlen packing). Each (mode, T) runs in a fresh process so its peak is its own:
peak = the process's peak RSS during the first pass minus its RSS just before (model and
inputs loaded). The GPU version of this is bench/capture_gpu.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, machine, table, write_json

# hidden 256 x 12 layers, 8192 embedding rows: the LM head is ~20% of the weights
# (Qwen3-8B: ~8%), so logits cost what they cost, not 100x more as with a 1K-vocab toy.
SPEC = dict(hidden=256, heads=4, kv_heads=2, intermediate=768, layers=12, model_vocab=8192)
MODES = ("naive", "capture_full_model", "capture_trimmed")


def _status_mib(key: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process, MiB. Not ru_maxrss: after fork+exec that
    starts at the parent's size."""
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: reset VmHWM to the current RSS


def worker(mode: str, T: int, seq_len: int, reps: int, threads: int) -> dict:
    """One mode at one size, in this (fresh) process."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash.producers.packing import check_packing
    from dflash.protocol.batch import position_ids
    from dflash.producers.target import Target
    from dflash.runtime.targets import default_layer_ids
    from dflash.tools.tiny import tiny_target

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(tiny_target(**SPEC), dtype=torch.float32, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    L = model.config.num_hidden_layers
    layer_ids = default_layer_ids(L)
    vocab = model.config.vocab_size
    target = None if mode == "naive" else Target(model, "tiny", layer_ids, full=mode == "capture_full_model")
    if mode == "capture_trimmed":
        del model  # what load_target does: only the trimmed decoder stays referenced
    kept = model if mode == "naive" else (target.model or target.decoder)
    weights_mib = sum(p.numel() * p.element_size() for p in kept.parameters()) / 2**20
    lens = [seq_len] * (T // seq_len) + ([T % seq_len] if T % seq_len else [])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (T,), generator=g)
    pos = position_ids(lens)

    def naive():
        with torch.inference_mode():
            out = model(input_ids=ids[None], position_ids=pos[None], output_hidden_states=True, use_cache=False)
            return torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], -1), out.logits

    fn = naive if mode == "naive" else (lambda: target.capture(ids, pos))
    base = _status_mib("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    out = fn()
    first_s = time.perf_counter() - t0
    peak = _status_mib("VmHWM") - base
    del out
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(reps):
        del_me = fn()
        del del_me
    sec = (time.perf_counter() - t0) / reps if reps else first_s
    # CPU seconds too: on a shared machine wall time includes waiting for a core.
    cpu = (time.process_time() - c0) / reps if reps else first_s
    n_kept = L if mode != "capture_trimmed" else max(layer_ids) + 1
    row = {"mode": mode, "tokens": T, "seqs": len(lens), "layer_ids": layer_ids, "layers_kept": n_kept,
           "weights_mib": weights_mib, "peak_above_weights_mib": peak, "s_per_pass": sec,
           "tokens_per_s": T / sec, "tokens_per_cpu_s": T / cpu, "threads": threads}
    if mode == "capture_trimmed":  # the check the producer runs at start-up
        row["packing_rel_err"], row["leak_rel_err"] = check_packing(target.capture, vocab, lens=(100, 180, 60))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1024,2048", help="tokens per packed batch")
    ap.add_argument("--seq-len", type=int, default=256, help="length of each packed sequence")
    ap.add_argument("--reps", type=int, default=2, help="timed passes after the first")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    ap.add_argument("--out", type=Path, default=RESULTS / "capture_cpu.json")
    ap.add_argument("--worker", nargs=2, metavar=("MODE", "T"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        row = worker(a.worker[0], int(a.worker[1]), a.seq_len, a.reps, a.threads)
        print("RESULT " + json.dumps(row))
        return 0
    from dflash.tools.tiny import tiny_target

    tiny_target(**SPEC)  # build once (cached) before the timed processes start
    rows = []
    for T in [int(x) for x in a.tokens.split(",")]:
        for mode in MODES:
            p = subprocess.run([sys.executable, __file__, "--worker", mode, str(T), "--seq-len", str(a.seq_len),
                                "--reps", str(a.reps), "--threads", str(a.threads)],
                               capture_output=True, text=True, timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"{mode} T={T} failed: {p.stderr[-2000:]}")
            rows.append(json.loads([x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1][7:]))
            print(f"{mode} T={T} done", file=sys.stderr, flush=True)
        naive = next(r for r in rows if r["mode"] == "naive" and r["tokens"] == T)
        for r in rows:
            if r["tokens"] == T:
                r["speed_vs_naive"] = r["tokens_per_cpu_s"] / naive["tokens_per_cpu_s"]
                r["peak_vs_naive"] = r["peak_above_weights_mib"] / naive["peak_above_weights_mib"]
    doc = {"bench": "capture_cpu", "machine": machine(), "spec": SPEC, "args": vars(a) | {"out": str(a.out)},
           "rows": rows}
    print(table(rows, [("tokens", "tokens"), ("mode", "mode"), ("layers_kept", "layers"),
                       ("weights_mib", "weights MiB"), ("tokens_per_s", "tok/s"), ("tokens_per_cpu_s", "tok/CPU-s"),
                       ("speed_vs_naive", "x naive (CPU-s)"), ("peak_above_weights_mib", "peak MiB"),
                       ("peak_vs_naive", "peak/naive")]))
    write_json(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
