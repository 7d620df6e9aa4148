"""Regeneration speed on one GPU at real prompt lengths, with the memory roofline beside
every figure: the decoding core as a producer runs it by default (rows sized by memory,
flex decode attention, the default prefill path), its other paths, and transformers' own
continuous batching (`generate_batch`) on the same prompts as the library baseline.

    python bench/regen_speed.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out results.json \
        [--targets real,qwen3-8b] [--jobs 4096] [--new 256]

Prompts are templated chats (bench/real_prompts.py's training set, rendered with the real
target's chat template and generation prompt). `real` is SmolLM2-135M-Instruct itself
(answers end at its own stop tokens, up to --new); `qwen3-8b` (and `smollm2-135m`) are
random-weight models of those shapes (tools/families.py) on the same prompt lengths, each
job's answer length drawn from the real target's answers (a random model never stops).

Roofline of a run: every decode step reads the weights once, and each generated token's
step reads the K/V of the slots it sees (prompt + answer so far); at the measured HBM
bandwidth that is the least time the run can take. Prefill compute is left out of it.

Exactness on the GPU (bf16): the default path's answers against the sdpa path's, and
against transformers' generate() at batch 1 on a subset; every difference is classified by
the tie rule of docs/EVAL.md (decode.divergence). Prints JSON lines; --out gets them all.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_speed as ds  # noqa: E402  (sets up `dflash` from this checkout; ceilings, timing)

import torch  # noqa: E402

from dflash.decoding.core import graphed_prefill_default, kv_bytes_per_slot  # noqa: E402
from dflash.decoding.greedy import GreedyDecoder, Job, pack_sizes  # noqa: E402
from dflash.decoding.ties import TIE_TOLERANCE, divergence, is_tie_flip  # noqa: E402
from dflash.producers.regenerate import kv_plan  # noqa: E402
from dflash.tools.families import build, shape_config  # noqa: E402

OUT: list[dict] = []


def emit(row: dict) -> dict:
    OUT.append(row)
    print(json.dumps(row), flush=True)
    return row


def templated_prompts(gguf: str, n: int, seed: int = 0) -> tuple[list[list[int]], object]:
    """`n` training prompts of bench/real_prompts.py as token IDs of the chat template's
    rendering with the generation prompt (what a producer's regeneration decodes from)."""
    import real_prompts
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name)
    rows, _ = real_prompts.build(tok, n, 0, seed)
    out = [tok(tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for r in rows[:n]]
    return out, tok


def default_rows(model, n_jobs: int, max_prompt: int, new: int) -> int:
    """The most rows a producer's decoder gets for these jobs (producers/regenerate.py kv_plan;
    this bench runs them on the fixed layout, as measured before paging)."""
    return kv_plan(model, ds.DEV, 0, n_jobs, max_prompt, new)["rows"]


def roofline(model, ceil: dict, jobs: list[Job], lens: dict, steps: int) -> dict:
    per_slot = kv_bytes_per_slot(model, model.dtype)
    kv = sum(per_slot * (a * len(j.prompt) + a * (a - 1) // 2) for j in jobs for a in [lens.get(j.key, 0)])
    wbytes, mm = ds.weights(model)
    new = sum(lens.values())
    t_mem = (steps * wbytes + kv) / ceil["hbm_bytes_per_s"]
    t_cmp = 2 * mm * new / ceil["bf16_flops_per_s"]  # the matmuls of every generated token
    t = max(t_mem, t_cmp)
    return {"roof_s": round(t, 3), "roof_tokens_per_s": round(new / t) if t else None,
            "roof_bound": "memory" if t_mem >= t_cmp else "compute", "roof_mem_s": round(t_mem, 3),
            "roof_flops_s": round(t_cmp, 3), "roof_kv_gb": round(kv / 1e9, 2),
            "roof_weight_gb": round(steps * wbytes / 1e9, 2)}


def run(model, jobs: list[Job], *, rows: int, new: int, stops: set[int], kernel: str, packed: bool | None,
        ceil: dict, label: str) -> tuple[dict, dict]:
    """One timed pass of GreedyDecoder over `jobs` after a warm-up pass (compiles, graph
    captures); returns (figures, outputs by job key)."""
    max_prompt = max(len(j.prompt) for j in jobs)
    if packed is None:
        packed = graphed_prefill_default(model, model.device)
    row = {"run": label, "rows": rows, "kernel": kernel, "graphed_prefill": packed, "jobs": len(jobs)}
    try:
        t0 = time.perf_counter()
        dec = GreedyDecoder(model, rows=rows, max_prompt=max_prompt, max_new_tokens=new, stop_ids=stops,
                            kernel=kernel, prefill_sizes=pack_sizes(4096) if packed else None)
        dec.run(deque(Job(-1 - i, j.prompt, max_new=8) for i, j in enumerate(jobs[:rows])), lambda j, o: None)
        ds.sync()
        row["warmup_s"] = round(time.perf_counter() - t0, 1)
        row["kernel_used"], row["kernel_error"] = dec.core.kernel, dec.core.kernel_error
        dec.steps = dec.prefills = dec.packed_prefills = 0
        outs: dict = {}
        t = time.perf_counter()
        dec.run(deque(jobs), lambda j, o: outs.__setitem__(j.key, o))
        ds.sync()
        secs = time.perf_counter() - t
        lens = {k: len(v) for k, v in outs.items()}
        tokens = sum(lens.values())
        row.update({"seconds": round(secs, 3), "new_tokens": tokens, "tokens_per_s": round(tokens / secs),
                    "steps": dec.steps, "ms_per_step": round(1e3 * secs / max(1, dec.steps), 3),
                    "prefills": dec.prefills, "slot_use": round(tokens / max(1, dec.steps * rows), 3),
                    "mean_answer": round(tokens / len(jobs), 1),
                    "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if ds.DEV.type == "cuda" else None,
                    **roofline(model, ceil, jobs, lens, dec.steps)})
        if row.get("roof_tokens_per_s"):
            row["of_roofline"] = round(row["tokens_per_s"] / row["roof_tokens_per_s"], 3)
        del dec
    except Exception as e:  # one path failing must not lose the others' figures
        row["error"] = f"{type(e).__name__}: {e}"[:600]
        outs = {}
    ds.empty_cache()
    if ds.DEV.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return emit(row), outs


def compare(model, jobs: list[Job], a: dict, b: dict, label: str, limit: int = 48) -> dict:
    """Jobs whose answers differ between two runs, each classified by the tie rule at its
    first difference (up to `limit` of them)."""
    by_key = {j.key: j for j in jobs}
    differ = [k for k in a if k in b and a[k] != b[k]]
    tol = TIE_TOLERANCE[model.dtype]
    ties = other = 0
    worst = []
    for k in differ[:limit]:
        d = divergence(model, by_key[k].prompt, a[k], b[k])
        if is_tie_flip(d, tol):
            ties += 1
        else:
            other += 1
            worst.append({"job": k, **d})
    return emit({"compare": label, "jobs": len(a), "identical": len(a) - len(differ), "differ": len(differ),
                 "checked": min(len(differ), limit), "tie_flips": ties, "not_ties": other, "not_tie_cases": worst[:5]})


def vs_generate(model, jobs: list[Job], ours: dict, new: int, stops: set[int], n: int) -> dict:
    """The default path's answers against transformers' generate() at batch 1."""
    ref = {}
    for j in jobs[:n]:
        ids = torch.tensor([j.prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=j.max_new or new,
                             eos_token_id=sorted(stops) or None, pad_token_id=0)[0, len(j.prompt):].tolist()
        end = next((i for i, t in enumerate(out) if t in stops), None)
        ref[j.key] = out if end is None else out[: end + 1]
    return compare(model, jobs[:n], {k: ours[k] for k in ref if k in ours}, ref, "default_vs_generate", limit=n)


def generate_batch(model, jobs: list[Job], new: int, stops: set[int], ceil: dict, n: int) -> dict:
    """transformers' continuous batching (paged attention) on the first `n` jobs."""
    from transformers import GenerationConfig

    row = {"run": "transformers_generate_batch", "jobs": n, "transformers": __import__("transformers").__version__}
    try:
        cfg = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=sorted(stops) or None, pad_token_id=0)
        model.generate_batch(inputs=[j.prompt for j in jobs[:32]], generation_config=cfg)  # warm-up
        ds.sync()
        t = time.perf_counter()
        res = model.generate_batch(inputs=[j.prompt for j in jobs[:n]], generation_config=cfg)
        ds.sync()
        secs = time.perf_counter() - t
        tokens = sum(len(o.generated_tokens) for o in res.values())
        row.update({"seconds": round(secs, 2), "new_tokens": tokens, "tokens_per_s": round(tokens / secs)})
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:600]
    model.set_attn_implementation("sdpa")
    ds.empty_cache()
    return emit(row)


def load(name: str, gguf: str):
    if name == "real":  # as a producer loads it: the GGUF converted once to a bf16 folder
        from dflash.runtime.targets import load_causal_lm

        model = load_causal_lm(gguf, dtype=torch.bfloat16, attn_implementation="sdpa")
    else:
        torch.manual_seed(0)
        with torch.device(ds.DEV):  # random init on the GPU: an 8B's on the host takes minutes
            model = build(shape_config(name), dtype=torch.bfloat16)
    return model.to(ds.DEV).eval().requires_grad_(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="SmolLM2-135M-Instruct's GGUF file (the tokenizer and the real target)")
    ap.add_argument("--targets", default="real,qwen3-8b")
    ap.add_argument("--jobs", type=int, default=3072, help="prompts for the 135M targets (a quarter for the 8B)")
    ap.add_argument("--new", type=int, default=256, help="new tokens at most per answer")
    ap.add_argument("--baseline-jobs", type=int, default=256, help="prompts for transformers' generate_batch")
    ap.add_argument("--runs", default="sdpa,before,prefill,vs_generate,generate_batch",
                    help="runs besides the default path: sdpa, before, prefill, vs_generate, generate_batch, rows=N")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t_start = time.monotonic()
    ds.TINY = ds.DEV.type != "cuda"  # a CPU smoke run of the script: small ceilings
    ceil = ds.ceilings()
    emit({"machine": torch.cuda.get_device_name() if ds.DEV.type == "cuda" else "cpu", "torch": torch.__version__,
          "transformers": __import__("transformers").__version__, **{k: round(v / 1e12, 2) for k, v in ceil.items()}})
    prompts, tok = templated_prompts(args.gguf, args.jobs)
    lens = [len(p) for p in prompts]
    emit({"prompts": len(prompts), "prompt_tokens_mean": round(statistics.mean(lens), 1), "prompt_tokens_max": max(lens)})
    answer_lens: list[int] = []
    for name in args.targets.split(","):
        model = load(name, args.gguf)
        real = name == "real"
        n = args.jobs if "8b" not in name else args.jobs // 4
        rng = random.Random(1)
        if real:
            stops = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id} - {None}
            jobs = [Job(i, p) for i, p in enumerate(prompts[:n])]
        else:  # a random model never stops: answers as long as the real target's
            stops = set()
            V = model.config.vocab_size
            jobs = [Job(i, [t % V for t in p], max_new=rng.choice(answer_lens) if answer_lens else rng.randint(32, args.new))
                    for i, p in enumerate(prompts[:n])]
        rows = default_rows(model, len(jobs), -(-max(len(j.prompt) for j in jobs) // 64) * 64, args.new)
        emit({"target": name, "params": sum(p.numel() for p in model.parameters()), "default_rows": rows,
              "kv_bytes_per_slot": kv_bytes_per_slot(model, model.dtype), "elapsed_s": round(time.monotonic() - t_start)})
        common = dict(new=args.new, stops=stops, ceil=ceil)
        runs = set(args.runs.split(","))
        head, outs = run(model, jobs, rows=rows, kernel="auto", packed=None, label=f"{name}:default", **common)
        if real and outs:
            answer_lens = [len(o) for o in outs.values()]
        sdpa = {}
        if "sdpa" in runs:
            _, sdpa = run(model, jobs, rows=rows, kernel="sdpa", packed=None, label=f"{name}:sdpa_same_rows", **common)
        if "before" in runs:
            run(model, jobs, rows=256, kernel="sdpa", packed=False, label=f"{name}:before(sdpa,256 rows,eager prefill)",
                **common)
        if "prefill" in runs:
            run(model, jobs, rows=rows, kernel="auto", packed=not graphed_prefill_default(model, model.device),
                label=f"{name}:default_other_prefill", **common)
        for r in (int(x[5:]) for x in runs if x.startswith("rows=")):
            run(model, jobs, rows=r, kernel="auto", packed=None, label=f"{name}:rows={r}", **common)
        try:  # a random model's top-2 margins sit below bf16 rounding: only the real one's differences mean anything
            if real and outs and sdpa:
                compare(model, jobs, outs, sdpa, f"{name}:default_vs_sdpa")
            if real and outs and "vs_generate" in runs:
                vs_generate(model, jobs, outs, args.new, stops, 12)
        except Exception as e:  # the speed figures stand without it
            emit({"compare_error": f"{type(e).__name__}: {e}"[:600]})
        if real and outs and "generate_batch" in runs:
            generate_batch(model, jobs, args.new, stops, ceil, args.baseline_jobs)
        del model
        ds.empty_cache()
        if args.out:
            Path(args.out).write_text(json.dumps(OUT, indent=1))
    emit({"done_s": round(time.monotonic() - t_start)})
    if args.out:
        Path(args.out).write_text(json.dumps(OUT, indent=1))


if __name__ == "__main__":
    main()
