"""Speed of the decoding core (decoding/) on one GPU, with the roofline next to
every figure, and its exactness there.

    python bench/decode_speed.py --out results.json [--shapes smollm2-135m,qwen3-0.6b,qwen3-8b]

Targets are random-weight models built from configs of real shapes (tools/families.py:
SmolLM2-135M, Qwen3-0.6B, Qwen3-8B): shape alone decides speed. bf16, sdpa. Sections:

  ceilings    HBM copy bandwidth and a bf16 8192^3 matmul, measured here: the roofline's
              two ceilings;
  steps       ms per decode step of all rows, batch 1/16/64/256, prompts of --prompt
              tokens: the core's graphed step, and the loop it replaced (transformers'
              forward + DynamicCache, one host sync per step) at batch 1 and 256; next to
              each, the roofline max(bytes / bandwidth, FLOPs / peak) for weights + KV read;
  exactness   the core against transformers' generate() (bf16, greedy) on a few prompts,
              batched and at batch 1, by the tie rule of docs/EVAL.md: the final norm is
              scaled so the logits spread like a trained model's (a random model's top-2
              margins are far below bf16 rounding, which would make every check a tie);
  regen       regeneration with continuous batching at batch 256: prompts of 32..384
              tokens, answers of 32..256 (a per-job length stands in for stop tokens);
              new tokens/s and slot utilisation;
  eval        dflash-eval at batch 1 on the 135M shape: target-only and speculative
              (a random 5-layer drafter, B=16: tau near 1, the slow case), 40 prompts x 256
              tokens, both wall-clock; outputs compared by the tie rule;
  cycle       ms per speculative cycle (one graph replay) against the target's decode
              step at batch 1, random drafters of 1/2/3/5 layers, eager and fused;
  compile     the same decode step through torch.compile, in the core's CUDA graph, against
              the eager one (ms per step, same tokens), time-guarded;
  where       where regeneration's time goes at batch 256: the graphed step's cost against
              the cache's slots (every step attends all of them), the regen loop split into
              prefill forwards, graphed steps and the host's turn-around, with eager
              prefills and with PackedPrefill's graphed packs, and the step's GPU time by
              kernel (torch.profiler).

Imports torch, transformers and the project's decoding modules only (no zmq/structlog), so
it runs on a bare GPU machine from a checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _project() -> None:
    """`dflash.*` from this checkout when the package is not installed (bare GPU machine)."""
    try:
        import dflash.decoding.greedy  # noqa: F401
    except ImportError:
        pkg = types.ModuleType("dflash")
        pkg.__path__ = [str(ROOT)]
        sys.modules["dflash"] = pkg


_project()

import torch  # noqa: E402

from dflash.decoding.core import kv_bytes_per_slot  # noqa: E402
from dflash.decoding.greedy import GreedyDecoder, Job, pack_sizes  # noqa: E402
from dflash.decoding.ties import TIE_TOLERANCE, divergence  # noqa: E402
from dflash.tools.families import build, shape_config  # noqa: E402

T0 = time.monotonic()
RESULTS: dict = {}
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TINY = False  # --tiny: a CPU smoke run of the script itself on tiny models (no figures)


def elapsed() -> float:
    return time.monotonic() - T0


def save(path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(RESULTS, indent=1))


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    """Mean seconds per call of fn over `reps` calls (CUDA events)."""
    if DEV.type != "cuda":
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    sync()
    return start.elapsed_time(end) / 1e3 / reps


# ---------------------------------------------------------------- ceilings


def ceilings() -> dict:
    n = 2**20 if TINY else 2**30 // 2
    x = torch.empty(n, dtype=torch.bfloat16, device=DEV)  # 1 GiB
    y = torch.empty_like(x)
    for _ in range(3):  # clocks up first: a cold copy read a third of the bandwidth
        y.copy_(x)
    t = timed(lambda: y.copy_(x), 10)
    bw = 2 * x.numel() * 2 / t  # read + write
    m = 256 if TINY else 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=DEV)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=DEV)
    for _ in range(3):
        a @ b
    t = timed(lambda: a @ b, 10)
    x = y = a = b = None  # freed (the lambdas above are done with them)
    empty_cache()
    return {"hbm_bytes_per_s": bw, "bf16_flops_per_s": 2 * m**3 / t}


def empty_cache() -> None:
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- model figures


def weights(model) -> tuple[int, int]:
    """(bytes read per step, matmul parameters per token): unique parameters; the input
    embedding is a lookup (not read whole) unless it is also the LM head."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    seen, total, mm = set(), 0, 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if p is emb and emb.data_ptr() != head.data_ptr():
            continue
        total += p.numel() * p.element_size()
        if p.dim() == 2:
            mm += p.numel()
    return total, mm


def roofline(model, ceil: dict, batch: int, ctx: int) -> dict:
    cfg = model.config
    wbytes, mm = weights(model)
    kv = kv_bytes_per_slot(model, torch.bfloat16) * ctx * batch
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    flops = batch * (2 * mm + 4 * cfg.num_hidden_layers * cfg.num_attention_heads * hd * ctx)
    t_mem = (wbytes + kv) / ceil["hbm_bytes_per_s"]
    t_cmp = flops / ceil["bf16_flops_per_s"]
    return {"weight_bytes": wbytes, "kv_bytes": kv, "flops": flops, "roof_ms": round(1e3 * max(t_mem, t_cmp), 4),
            "roof_mem_ms": round(1e3 * t_mem, 4), "roof_flops_ms": round(1e3 * t_cmp, 4)}


def prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ---------------------------------------------------------------- decode steps


def old_loop_ms(model, rows: list[list[int]], steps: int) -> float:
    """ms per decode step of the loop the core replaced (transformers' forward with a
    DynamicCache, attention mask grown each step, one host sync per step)."""
    from transformers import DynamicCache

    from dflash.runtime.hf_compat import cache_kwarg

    dev = model.device
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in rows], device=dev)
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=dev)
    pos = (att.cumsum(-1) - 1).clamp_min(0)
    kw = {cache_kwarg(model): DynamicCache(config=model.config)}
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=True, logits_to_keep=1, **kw)
        nxt = out.logits[:, -1].argmax(-1)
        done = torch.zeros_like(nxt, dtype=torch.bool)
        pos = pos[:, -1:]
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            bool(done.all())
            att = torch.cat([att, torch.ones_like(att[:, :1])], dim=1)
            pos = pos + 1
            out = model(input_ids=nxt[:, None], attention_mask=att, position_ids=pos, use_cache=True,
                        logits_to_keep=1, **kw)
            nxt = out.logits[:, -1].argmax(-1)
        sync()
    return 1e3 * (time.perf_counter() - t) / steps


def steps_section(name: str, model, ceil: dict, batches: list[int], P: int, old_batches: set[int]) -> list[dict]:
    out = []
    vocab = model.config.vocab_size
    for B in batches:
        row = {"shape": name, "batch": B, "prompt": P}
        try:
            dec = GreedyDecoder(model, rows=B, max_prompt=P, max_new_tokens=80, stop_ids=set())
            row["graphs"] = dec.core.captured > 0
            row["graph_error"] = dec.core.graph_error
            with torch.inference_mode():
                dec._fill([(r, Job(r, p)) for r, p in enumerate(prompts(B, P, P, vocab, seed=B))])
                for _ in range(4):
                    dec._step()
                t = timed(dec._step, 48)
            row["ms_per_step"] = round(1e3 * t, 4)
            row["tokens_per_s"] = round(B / t, 1)
            row.update(roofline(model, ceil, B, P + 30))
            row["of_roofline"] = round(row["roof_ms"] / row["ms_per_step"], 4)
            del dec
            if B in old_batches:
                ms = old_loop_ms(model, prompts(B, P, P, vocab, seed=B), 12)
                row["old_loop_ms_per_step"] = round(ms, 3)
                row["old_loop_tokens_per_s"] = round(B / ms * 1e3, 1)
                row["speedup_vs_old"] = round(ms / row["ms_per_step"], 2)
        except Exception as e:  # a figure missing is reported, the rest still runs
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        empty_cache()
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


# ---------------------------------------------------------------- exactness


def exactness(name: str, model, n: int = 8, new: int = 48) -> dict:
    """The core (batched and batch 1) against generate() per prompt, bf16, tie rule."""
    norm = model.model.norm.weight
    saved = norm.detach().clone()
    norm.data.mul_(8.0)  # logits spread like a trained model's (see the module docstring)
    model.generation_config.eos_token_id = None  # exactly `new` tokens, no stop, as the core here
    tol = TIE_TOLERANCE[torch.bfloat16]
    ps = prompts(n, 16, 96, model.config.vocab_size, seed=11)
    res = {"shape": name, "prompts": n, "new_tokens": new, "tolerance": tol}
    try:
        with torch.inference_mode():
            ref = [model.generate(torch.tensor([p], device=DEV), do_sample=False, max_new_tokens=new,
                                  pad_token_id=0)[0, len(p):].tolist()
                   for p in ps]
        dec = GreedyDecoder(model, rows=n, max_prompt=96, max_new_tokens=new, stop_ids=set())
        batched = dec.generate(ps)
        one = GreedyDecoder(model, rows=1, max_prompt=96, max_new_tokens=new, stop_ids=set())
        single = [one.generate([p])[0] for p in ps]
        for label, got in (("batched", batched), ("batch1", single)):
            exact = ties = bad = 0
            margins = []
            for p, r, g in zip(ps, ref, got):
                div = divergence(model, p, r, g)
                if div is None:
                    exact += 1
                    continue
                margins.append(div["flip_margin"])
                ties += div["flip_margin"] is not None and div["flip_margin"] <= tol
                bad += not (div["flip_margin"] is not None and div["flip_margin"] <= tol)
            res[label] = {"exact": exact, "tie_flips": ties, "mismatches": bad,
                          "flip_margins": [round(m, 4) if m is not None else None for m in margins]}
        # How wide a trained-like logit spread is here: the top-2 margins at each prompt's first step.
        with torch.inference_mode():
            top2 = []
            for p in ps:
                lg = model(input_ids=torch.tensor([p], device=DEV), logits_to_keep=1).logits[0, -1].float()
                v = lg.topk(2).values
                top2.append(round(float(v[0] - v[1]), 4))
        res["top2_margin_first_step"] = top2
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"[:400]
    finally:
        norm.data.copy_(saved)
    print(json.dumps(res), flush=True)
    return res


# ---------------------------------------------------------------- regeneration


def regen_section(name: str, model, jobs: int, rows: int = 256) -> dict:
    res = {"shape": name, "rows": rows, "jobs": jobs}
    try:
        dec, q, got, t = _run_regen(model, prompts(jobs, 32, 384, model.config.vocab_size, seed=3), rows)
        new = sum(got.values())
        res.update({"seconds": round(t, 3), "new_tokens": new, "tokens_per_s": round(new / t, 1),
                    "steps": dec.steps, "ms_per_step": round(1e3 * t / dec.steps, 3),
                    "slot_utilisation": round(new / (dec.steps * rows), 4), "graphs": dec.core.captured > 0,
                    "all_lengths_right": all(got[j.key] == j.max_new for j in q)})
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"[:400]
    empty_cache()
    print(json.dumps(res), flush=True)
    return res


def _run_regen(model, ps: list[list[int]], rows: int, sizes=None, wrap_fill=None):
    """GreedyDecoder.run over `ps`, answers of 32..256 tokens drawn per job, after a warm-up
    round (graph captures, allocator): (decoder, jobs, new tokens by job key, seconds).
    `sizes`: PackedPrefill's; `wrap_fill`: replaces the decoder's `_fill` by wrap_fill(_fill)."""
    from collections import deque

    rng = random.Random(5)
    jobs = [Job(i, p, max_new=rng.randint(32, 256)) for i, p in enumerate(ps)]
    dec = GreedyDecoder(model, rows=rows, max_prompt=384, max_new_tokens=256, stop_ids=set(), prefill_sizes=sizes)
    dec.run(deque(Job(-1 - i, p, max_new=16) for i, p in enumerate(ps[:rows])), lambda j, o: None)
    if wrap_fill is not None:
        dec._fill = wrap_fill(dec._fill)
    dec.steps = dec.prefills = dec.packed_prefills = 0
    got: dict = {}
    sync()
    t = time.perf_counter()
    dec.run(deque(jobs), lambda j, o: got.__setitem__(j.key, len(o)))
    sync()
    return dec, jobs, got, time.perf_counter() - t


# ---------------------------------------------------------------- eval


def eval_section(model, n: int = 40, new: int = 256) -> dict:
    from dflash.consumers.evaluation.speculative import Speculative, TargetGreedy

    cfg = model.config
    drafter = _random_drafter(model, 5)
    ps = prompts(n, 32, 200, cfg.vocab_size, seed=9)
    res = {"prompts": n, "max_new_tokens": new, "drafter_layers": 5, "block_size": 16}
    try:
        t = time.perf_counter()
        base_dec = TargetGreedy(model, max_prompt=200, max_new_tokens=new, stop_ids=set())
        spec_dec = Speculative(model, drafter, max_prompt=200, max_new_tokens=new, stop_ids=set())
        base_dec(ps[0])
        spec_dec(ps[0])
        res["setup_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        base = [base_dec(p) for p in ps]
        t_base = time.perf_counter() - t
        t = time.perf_counter()
        spec = [spec_dec(p) for p in ps]
        t_spec = time.perf_counter() - t
        tol = TIE_TOLERANCE[torch.bfloat16]
        exact = ties = bad = 0
        margins = []
        for p, b, s in zip(ps, base, spec):
            div = divergence(model, p, b.tokens, s.tokens)
            if div is None:
                exact += 1
                continue
            margins.append(div["flip_margin"])
            tie = div["flip_margin"] is not None and div["flip_margin"] <= tol
            ties += tie
            bad += not tie
        toks = sum(len(b.tokens) for b in base)
        cycles = sum(len(s.accept_lengths) for s in spec)
        res.update({"target_only_s": round(t_base, 3), "target_only_tokens_per_s": round(toks / t_base, 1),
                    "target_only_ms_per_token": round(1e3 * t_base / toks, 4),
                    "speculative_s": round(t_spec, 3),
                    "speculative_tokens_per_s": round(sum(len(s.tokens) for s in spec) / t_spec, 1),
                    "tau": round(sum(len(s.tokens) - 1 for s in spec) / max(1, cycles), 4),
                    "ms_per_cycle": round(1e3 * t_spec / max(1, cycles), 4),
                    "both_s": round(t_base + t_spec, 3), "exact": exact, "tie_flips": ties, "mismatches": bad,
                    "flip_margins": [round(m, 4) if m is not None else None for m in margins],
                    "graphs": spec_dec.core.captured > 0, "graph_error": spec_dec.core.graph_error})
    except Exception as e:
        import traceback

        res["error"] = f"{type(e).__name__}: {e}"[:400]
        traceback.print_exc()
    print(json.dumps(res), flush=True)
    return res


def cycle_section(model, layers: list[int], reps: int = 200) -> list[dict]:
    """ms per speculative cycle (draft, verify, accept: one graph replay) against the
    target's decode step at batch 1, by drafter depth, with the drafter's elementwise work
    eager and fused (dflash-eval --fuse): what a cycle costs decides the speedup at a tau."""
    from dflash.consumers.drafter import fused
    from dflash.consumers.evaluation.speculative import Speculative, TargetGreedy

    out = []
    p = prompts(1, 120, 120, model.config.vocab_size, seed=11)[0]
    base = TargetGreedy(model, max_prompt=200, max_new_tokens=256, stop_ids=set())
    base(p)
    with base.dec.core.attending(), torch.inference_mode():
        step_ms = 1e3 * timed(base.dec._step, reps)
    for fuse in (False, True):
        fused.enable(fuse)
        for n in layers:
            res = {"drafter_layers": n, "fuse": fuse, "target_step_ms": round(step_ms, 4)}
            try:
                drafter = _random_drafter(model, n)
                spec = Speculative(model, drafter, max_prompt=200, max_new_tokens=256, stop_ids=set())
                spec(p, 8)
                with spec.core.attending(), torch.inference_mode():
                    spec.start.fill_(len(p))
                    res["cycle_ms"] = round(1e3 * timed(spec._cycle, reps), 4)
                res["cycle_over_step"] = round(res["cycle_ms"] / step_ms, 3)
                res["graphs"] = spec.core.captured > 0
            except Exception as e:
                res["error"] = f"{type(e).__name__}: {e}"[:400]
            print(json.dumps(res), flush=True)
            out.append(res)
    fused.enable(False)
    return out


def _random_drafter(model, n_layers: int):
    from dflash.consumers.export.export import Drafter
    from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig

    cfg = model.config
    L = cfg.num_hidden_layers
    layer_ids = sorted({round(1 + i * (L - 4) / 4) for i in range(5)})  # spaced 1..L-3
    dcfg = DrafterConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                         head_dim=cfg.head_dim, num_layers=n_layers, num_features=len(layer_ids),
                         rope_theta=getattr(cfg, "rope_theta", 10000.0))
    torch.manual_seed(0)
    draft = DFlashDraft(dcfg).to(DEV, torch.bfloat16).eval().requires_grad_(False)
    return Drafter(draft, 16, cfg.vocab_size - 1, layer_ids, L, {})


# ---------------------------------------------------------------- where the time goes


def where_section(name: str, model, jobs: int, rows: int = 256) -> dict:
    """Regeneration's time at `rows` rows split three ways, each measured on its own: the
    graphed step against slots, the loop's prefills (synchronised around each, so their
    GPU time is theirs), eager and packed into graphed sizes (PackedPrefill), and the
    step's kernels."""
    vocab = model.config.vocab_size
    res: dict = {"shape": name, "rows": rows, "jobs": jobs, "step_ms_by_slots": {}}
    for P in (64, 192, 384, 640):  # slots = P + 256 + 1, as regeneration sizes them
        try:
            dec = GreedyDecoder(model, rows=rows, max_prompt=P, max_new_tokens=256, stop_ids=set())
            with torch.inference_mode():
                dec._fill([(r, Job(r, p)) for r, p in enumerate(prompts(rows, P // 2, P // 2, vocab, seed=P))])
                with dec.core.attending():
                    res["step_ms_by_slots"][dec.core.slots] = round(1e3 * timed(dec._step, 24), 4)
            del dec
        except Exception as e:
            res["step_ms_by_slots"][P + 257] = f"{type(e).__name__}: {e}"[:200]
        empty_cache()
    ps = prompts(jobs, 32, 384, vocab, seed=3)
    for name_, sizes in (("loop", None), ("loop_packed_prefill", pack_sizes(4096))):
        try:
            res[name_] = _timed_loop(model, ps, rows, sizes, kernels=name_ == "loop")
            if "step_kernels" in res[name_]:
                res["step_kernels"] = res[name_].pop("step_kernels")
        except Exception as e:
            res[name_] = {"error": f"{type(e).__name__}: {e}"[:400]}
        empty_cache()
    print(json.dumps(res), flush=True)
    return res


def _timed_loop(model, ps: list[list[int]], rows: int, sizes, *, kernels: bool) -> dict:
    """`_run_regen` with each prefill timed between two synchronisations, against its graphed
    steps timed alone; `sizes`: PackedPrefill's; `kernels`: the step's kernel table too."""
    fill = {"s": 0.0, "n": 0, "tokens": 0}

    def timing(inner):
        def timed_fill(take):
            sync()
            t0 = time.perf_counter()
            inner(take)
            sync()
            fill["s"] += time.perf_counter() - t0
            fill["n"] += 1
            fill["tokens"] += sum(len(j.prompt) for _, j in take)
        return timed_fill

    dec, _, got, t = _run_regen(model, ps, rows, sizes, wrap_fill=timing)
    with dec.core.attending(), torch.inference_mode():
        step_s = timed(dec._step, 24)
        table = _kernels(dec._step, 8) if kernels else None
    new = sum(got.values())
    res = {"seconds": round(t, 3), "new_tokens": new, "tokens_per_s": round(new / t, 1), "steps": dec.steps,
           "graphed_steps_s": round(dec.steps * step_s, 3), "step_ms": round(1e3 * step_s, 4),
           "fills": fill["n"], "prefill_forwards": dec.prefills, "packed": dec.packed_prefills,
           "prefill_replays": dec.prefill.replays if dec.prefill else 0, "prefill_graphs": max(0, dec.core.captured - 1),
           "prefill_tokens": fill["tokens"], "fill_s": round(fill["s"], 3),
           "host_s": round(t - fill["s"] - dec.steps * step_s, 3),
           "slot_utilisation": round(new / max(1, dec.steps * rows), 4)}
    return {**res, "step_kernels": table} if kernels else res


def _kernels(fn, reps: int, top: int = 12) -> list[dict]:
    """GPU time per call of `fn` by kernel name, the `top` largest (torch.profiler)."""
    if DEV.type != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        sync()
    rows = [(e.key, getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0), e.count)
            for e in prof.key_averages()]
    rows = sorted((r for r in rows if r[1]), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    out = [{"kernel": k[:90], "us_per_call": round(us / reps, 1), "count_per_call": n // reps} for k, us, n in rows[:top]]
    return [{"kernel": "(all)", "us_per_call": round(total / reps, 1), "count_per_call": sum(r[2] for r in rows) // reps},
            *out]


# ---------------------------------------------------------------- torch.compile


def compile_section(model, B: int, P: int = 256) -> dict:
    """The decode step through torch.compile (inductor fuses the elementwise work), then
    captured in the core's own CUDA graph like the eager step; ms per step both ways, and
    whether the two give the same tokens over 64 steps from the same state."""
    res = {"batch": B, "mode": "default, then the core's CUDA graph"}
    try:
        ps = prompts(B, P, P, model.config.vocab_size, seed=B)
        eager = GreedyDecoder(model, rows=B, max_prompt=P, max_new_tokens=80, stop_ids=set())
        dec = GreedyDecoder(model, rows=B, max_prompt=P, max_new_tokens=80, stop_ids=set(), graphs=False)
        raw = GreedyDecoder._decode_step.__wrapped__  # without its inference_mode: dynamo refuses that
        fn = torch.compile(lambda: raw(dec), dynamic=False)
        with torch.inference_mode(), dec.core.attending():
            for d in (eager, dec):
                d._fill([(r, Job(r, p)) for r, p in enumerate(ps)])
            t = time.perf_counter()
            fn()
            sync()
            res["compile_s"] = round(time.perf_counter() - t, 2)
            dec.core.graphs = DEV.type == "cuda"
            step = dec.core.graphed(fn)  # its warm-up runs 2 more steps: the eager one catches up
            res["graphs"] = dec.core.captured > 0
            for _ in range(3):
                eager._step()
            for _ in range(61):
                step()
                eager._step()
            sync()
            res["same_tokens"] = round(float((dec.out == eager.out).float().mean()), 4)
            res["ms_per_step"] = round(1e3 * timed(step, 48), 4)
            res["eager_ms_per_step"] = round(1e3 * timed(eager._step, 48), 4)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"[:400]
    print(json.dumps(res), flush=True)
    return res


def compile_subprocess(name: str, B: int, timeout_s: float) -> dict:
    """compile_section in a child process, killed after `timeout_s` (compilation time is unbounded)."""
    import subprocess

    cmd = [sys.executable, __file__, "--compile-only", name, "--batches", str(B)] + (["--tiny"] if TINY else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"shape": name, "batch": B, "error": f"not done in {timeout_s:.0f} s"}
    rows = [json.loads(x) for x in p.stdout.splitlines() if x.startswith('{"batch"')]
    if rows:
        return {"shape": name, **rows[-1]}
    return {"shape": name, "batch": B, "error": f"rc {p.returncode}: {p.stderr[-300:]}"}


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--shapes", default="smollm2-135m,qwen3-8b,qwen3-0.6b")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per row in the step timings")
    ap.add_argument("--regen-jobs", type=int, default=2048, help="regeneration jobs (135M; a quarter for 8B)")
    ap.add_argument("--budget-s", type=float, default=420, help="skip optional sections past this many seconds")
    ap.add_argument("--sections", default="steps,exactness,regen,eval,compile", help="which sections to run")
    ap.add_argument("--tiny", action="store_true", help="smoke-run the script on tiny models (CPU works)")
    ap.add_argument("--compile-only", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    global TINY
    TINY = a.tiny
    if a.compile_only:
        with DEV:
            model = _model(a.compile_only)
        compile_section(model, int(a.batches), 16 if TINY else 256)
        return
    import transformers

    RESULTS["machine"] = {"gpu": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", "torch": torch.__version__,
                          "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    RESULTS["ceilings"] = ceil = ceilings()
    print(json.dumps(RESULTS), flush=True)
    batches = [int(b) for b in a.batches.split(",")]
    RESULTS.update(steps=[], exactness=[], regen=[], eval=None, cycle=[], compile=[], where=[])
    for name in a.shapes.split(","):
        t = time.perf_counter()
        with DEV:
            model = _model(name)
        print(f"# {name}: built in {time.perf_counter() - t:.1f} s at {elapsed():.0f} s", flush=True)
        want = set(a.sections.split(","))
        if "steps" in want:
            RESULTS["steps"] += steps_section(name, model, ceil, batches, 16 if TINY else a.prompt, {1, max(batches)})
        save(a.out)
        if name != "qwen3-8b" and "exactness" in want:
            RESULTS["exactness"].append(exactness(name, model))
        if name in ("smollm2-135m", "qwen3-8b") and "regen" in want:
            RESULTS["regen"].append(regen_section(name, model, a.regen_jobs if name != "qwen3-8b" else a.regen_jobs // 4,
                                                  rows=max(batches)))
        if "where" in want:
            RESULTS["where"].append(where_section(name, model, 16 if TINY else (a.regen_jobs if name != "qwen3-8b"
                                                                                else a.regen_jobs // 4),
                                                  rows=max(batches)))
            save(a.out)
        if name == "smollm2-135m" and "eval" in want:
            RESULTS["eval"] = eval_section(model, 4 if TINY else 40, 24 if TINY else 256)
            save(a.out)
        if name == "smollm2-135m" and "cycle" in want:
            RESULTS["cycle"] = cycle_section(model, [1, 2, 3, 5], 24 if TINY else 200)
            save(a.out)
        if name == "smollm2-135m" and "compile" in want:
            if elapsed() < a.budget_s - 30:  # compiling takes what it takes: the rest of the budget at most
                RESULTS["compile"].append(compile_subprocess(name, max(batches), a.budget_s - elapsed()))
        save(a.out)
        del model
        torch.cuda.empty_cache()
        if elapsed() > a.budget_s:
            print(f"# budget spent at {elapsed():.0f} s: stopping", flush=True)
            break
    RESULTS["total_s"] = round(elapsed(), 1)
    save(a.out)
    table()


def _model(name: str):
    if TINY:
        from dflash.tools.families import tiny_config

        cfg = tiny_config("llama" if name.startswith("smollm2") else "qwen3", layers=8, tie=name.startswith("smollm2"))
        return build(cfg, dtype=torch.bfloat16)
    return build(shape_config(name), dtype=torch.bfloat16)


def table() -> None:
    print(f"\n{'shape':<14} {'batch':>5} {'ms/step':>9} {'tok/s':>10} {'roof ms':>8} {'of roof':>7} "
          f"{'old ms':>8} {'x old':>6}")
    for r in RESULTS["steps"]:
        if "error" in r:
            print(f"{r['shape']:<14} {r['batch']:>5} error: {r['error'][:80]}")
            continue
        print(f"{r['shape']:<14} {r['batch']:>5} {r['ms_per_step']:>9.3f} {r['tokens_per_s']:>10.0f} "
              f"{r['roof_ms']:>8.3f} {r['of_roofline']:>7.2%} {r.get('old_loop_ms_per_step', ''):>8} "
              f"{r.get('speedup_vs_old', ''):>6}")
    for r in RESULTS["regen"]:
        print("regen", json.dumps(r))
    print("eval", json.dumps(RESULTS["eval"]))
    for r in RESULTS["exactness"]:
        print("exactness", json.dumps(r))
    for r in RESULTS["compile"]:
        print("compile", json.dumps(r))
    for r in RESULTS["where"]:
        print("where", json.dumps({k: v for k, v in r.items() if k != "step_kernels"}))
        for k in r.get("step_kernels", []):
            print(f"   {k['us_per_call']:>9.1f} us  x{k['count_per_call']:<4} {k['kernel']}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
