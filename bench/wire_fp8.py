"""fp8 (e4m3, per-row scale) vs bf16 hidden states on the wire: bytes, CPU speed, training effect.

    python bench/wire_fp8.py                 # ~2 min on 2 cores
    python bench/wire_fp8.py --steps 100 --out /tmp/fp8.json

1. Bytes per token of a Qwen3-8B capture (5 x 4096) in each encoding.
2. encode_fp8 / decode_fp8 throughput on this CPU for a 1024-token batch.
3. The real drafter (consumers.training.train) trained twice on identical batches, same seed: once
   on what the bf16 wire delivers, once on what the fp8 wire delivers. Batches go through
   codec.encode -> codec.decode exactly as on the wire; train() takes the decoded messages.
   The stream is consumers.process.synthetic's learnable one; `outliers` adds a few channels 1000x
   larger, like the massive activations of real LLM hidden states, which is the case a
   per-row scale could get wrong (one outlier sets the scale of its whole row). Each pair
   runs for several drafter seeds, so the bf16/fp8 gap reads against seed-to-seed noise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from structlog.testing import capture_logs

from common import HIDDEN, N_LAYERS, RESULTS, machine, table, write_json
from dflash.consumers.process.synthetic import rule_batch
from dflash.runtime.target_heads import load_target_heads
from dflash.consumers.training.train import train
from dflash.consumers.training.config import TrainConfig
from dflash.protocol import codec
from dflash.protocol.fp8 import ENCODING as ENCODING
from dflash.protocol.fp8 import decode_fp8, encode_fp8
from dflash.protocol.fields import header

LAYERS = [1, 2]
MASK_ID = 511


def bytes_per_token(n_layers: int = N_LAYERS, hidden: int = HIDDEN) -> dict:
    ids_mask = 4 + 1
    return {"bf16": n_layers * hidden * 2 + ids_mask, "fp8_rowscale": n_layers * hidden + 4 * n_layers + ids_mask}


def codec_speed(tokens: int = 1024, min_s: float = 1.0) -> dict:
    """GB/s of bf16 hidden states in (encode) and out (decode), tokens/s, on this CPU."""
    x = torch.randn(tokens, N_LAYERS * HIDDEN).to(torch.bfloat16)
    q, s = encode_fp8(x, N_LAYERS)
    out = {}
    for name, fn in (("encode", lambda: encode_fp8(x, N_LAYERS)), ("decode", lambda: decode_fp8(q, s))):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < min_s or n < 2:
            fn()
            n += 1
        dt = (time.perf_counter() - t0) / n
        out[name] = {"ms_per_batch": dt * 1e3, "bf16_gb_per_s": x.numel() * 2 / dt / 1e9, "tokens_per_s": tokens / dt}
    back = decode_fp8(q, s, torch.float32)
    rel = ((back - x.float()).norm(dim=1) / x.float().norm(dim=1))
    out["row_rel_err_mean"], out["row_rel_err_max"] = float(rel.mean()), float(rel.max())
    return out


def tiny_heads(folder: Path):
    """A real tiny Qwen3 saved the Hugging Face way (as tests/consumers build theirs):
    initializer_range 0.5 gives LM-head logits on the scale of a trained model's."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      tie_word_embeddings=False, initializer_range=0.5)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(folder)
    return load_target_heads(folder, dtype=torch.float32)


def wire_messages(heads, steps: int, encoding: str, outliers: float) -> list:
    """The same `steps` batches, encoded for the wire in `encoding` and decoded back."""
    msgs = []
    for i in range(steps):
        b = rule_batch(heads.spec, LAYERS, seed=i, sample_start=4 * i)
        hidden = b.hidden.clone()
        if outliers:
            hidden.view(b.tokens, len(LAYERS), -1)[:, :, :2] *= outliers  # 2 of 64 channels per layer
        fields = dict(batch_id=f"p1-{i}", producer="p1", lease=0, epoch=0, samples=b.samples,
                      seq_lens=b.seq_lens, layer_ids=LAYERS)
        tensors = {"input_ids": b.input_ids, "loss_mask": b.loss_mask}
        if encoding == "fp8":
            q, s = encode_fp8(hidden, len(LAYERS))
            tensors.update(hidden=q, hidden_scale=s)
            fields["hidden_encoding"] = ENCODING
        else:
            tensors["hidden"] = hidden.to(torch.bfloat16)  # the default wire dtype
        frames = [bytes(f) for f in codec.encode(header("batch", "bench", **fields), tensors)]
        msgs.append(codec.decode_batch(frames))
    return msgs


def train_on(heads, msgs: list, steps: int, tail: int, seed: int) -> dict:
    cfg = TrainConfig(draft_layers=2, target_layers=tuple(LAYERS), block_size=4, anchors=8, mask_token_id=MASK_ID,
                      lr=3e-3, total_steps=steps, log_position_every=0, seed=seed)
    t0 = time.perf_counter()
    with capture_logs() as logs:
        train(cfg, heads, iter(msgs))
    lines = [e for e in logs if e["event"] == "train.step"]
    last = lines[-tail:]
    mid = lines[len(lines) // 2 - tail // 2: len(lines) // 2 + tail // 2]
    mean = lambda xs, k: sum(e[k] for e in xs) / len(xs)  # noqa: E731
    return {"seed": seed, "steps": len(lines), "seconds": time.perf_counter() - t0,
            "loss_mid": mean(mid, "loss"), "acc_mid": mean(mid, "acc"),
            "loss_final": mean(last, "loss"), "acc_final": mean(last, "acc"),
            "loss_curve": [round(e["loss"], 4) for e in lines[:: max(1, len(lines) // 20)]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="training steps per run")
    ap.add_argument("--tail", type=int, default=20, help="steps averaged for the mid/final figures")
    ap.add_argument("--outliers", default="0,1000", help="outlier channel factors to run (0 = none)")
    ap.add_argument("--seeds", default="0,1,2", help="drafter init seeds (the batches are the same for all)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training (the machine is shared)")
    ap.add_argument("--out", type=Path, default=RESULTS / "wire_fp8.json")
    a = ap.parse_args(argv)
    doc = {"bench": "wire_fp8", "machine": machine(), "args": {k: str(v) for k, v in vars(a).items()}}
    doc["bytes_per_token"] = bpt = bytes_per_token()
    doc["codec_cpu"] = sp = codec_speed()
    print(f"bytes/token (Qwen3-8B, 5 layers): bf16 {bpt['bf16']}, fp8+scale {bpt['fp8_rowscale']} "
          f"({bpt['fp8_rowscale'] / bpt['bf16']:.3f}x)")
    print(f"CPU ({torch.get_num_threads()} threads), 1024 tokens: encode {sp['encode']['ms_per_batch']:.1f} ms "
          f"({sp['encode']['tokens_per_s']:,.0f} tok/s, {sp['encode']['bf16_gb_per_s']:.2f} GB/s of bf16), decode "
          f"{sp['decode']['ms_per_batch']:.1f} ms ({sp['decode']['tokens_per_s']:,.0f} tok/s); "
          f"row rel err mean {sp['row_rel_err_mean']:.4f} max {sp['row_rel_err_max']:.4f}")
    torch.set_num_threads(a.threads)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        heads = tiny_heads(Path(tmp) / "target")
        for factor in [float(x) for x in a.outliers.split(",")]:
            msgs = {enc: wire_messages(heads, a.steps, enc, factor) for enc in ("bf16", "fp8")}
            for seed in [int(x) for x in a.seeds.split(",")]:
                for enc in ("bf16", "fp8"):
                    r = train_on(heads, msgs[enc], a.steps, a.tail, seed)
                    runs.append({"outliers": factor, "wire": enc, **r})
                    print(f"  outliers={factor:g} seed={seed} {enc}: {r['seconds']:.0f}s", file=sys.stderr, flush=True)
    doc["training_runs"] = runs
    # One row per (outliers, wire): mean over seeds, and the seed-to-seed range, so a
    # bf16/fp8 difference can be read against the noise of training itself.
    rows = []
    for factor in dict.fromkeys(r["outliers"] for r in runs):
        for enc in ("bf16", "fp8"):
            rs = [r for r in runs if r["outliers"] == factor and r["wire"] == enc]
            row = {"outliers": factor, "wire": enc, "seeds": len(rs), "steps": rs[0]["steps"]}
            for k in ("loss_mid", "acc_mid", "loss_final", "acc_final"):
                vals = [r[k] for r in rs]
                row[k], row[k + "_range"] = sum(vals) / len(vals), f"{min(vals):.3g}..{max(vals):.3g}"
            rows.append(row)
    doc["training"] = rows
    print(table(rows, [("outliers", "outliers"), ("wire", "wire"), ("seeds", "seeds"), ("steps", "steps"),
                       ("loss_mid", "loss@mid"), ("acc_mid", "acc@mid"), ("loss_final", "loss final"),
                       ("loss_final_range", "(seeds)"), ("acc_final", "acc final"), ("acc_final_range", "(seeds)")]))
    write_json(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
