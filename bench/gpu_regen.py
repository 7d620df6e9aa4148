"""How fast `dflash-produce --regenerate` generates, and where the time per decode step goes.

    python bench/gpu_regen.py --target DIR --gpu 0 --batches 1,16,64 --new-tokens 64

The target is loaded as the producer loads it (`load_target(full=True)`, attention `auto`:
flex on a GPU, switched to sdpa for generation as `Regenerator` does). For each batch size,
prompts are the first user turns of the bundled sample chats (chat template applied, left
padded), and three ways of decoding exactly `--new-tokens` tokens are timed:

  generate    `model.generate` (greedy, sdpa), what `Regenerator` called before 2026-11-29;
  loop        `decoding.greedy.greedy_generate`, the decoding core `Regenerator` runs on
              now: a static KV cache, no logits processors or stopping criteria;
  forward     one decode step's forward alone, CUDA-synchronised: the model's own cost.

One JSON line per (batch, way): ms per decode step and new tokens/s.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import torch


def _prompts(tokenizer, n: int) -> list[list[int]]:
    from dflash.producers.sample_data import CHATS_PATH

    rows = [json.loads(x) for x in Path(CHATS_PATH).read_text().splitlines()[:n]]
    out = []
    for r in rows:
        first_user = next(m for m in r["messages"] if m["role"] == "user")
        text = tokenizer.apply_chat_template([first_user], tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def _left_pad(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, att


def _timed(fn, device) -> float:
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    return time.perf_counter() - t0


def _generate(model, ids, att, pad, n):
    return model.generate(input_ids=ids, attention_mask=att, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=pad, temperature=None, top_p=None, top_k=None)


def _prefilled(model, ids, att):
    """The prompts' KV cache (as the forward() keyword), positions and first greedy token:
    the state one decode step starts from."""
    from dflash.runtime.hf_compat import cache_kwarg, new_cache

    kw = {cache_kwarg(model): new_cache(model)}
    pos = (att.cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=True, **kw)
    return kw, pos[:, -1:], out.logits[:, -1].argmax(-1, keepdim=True)


@click.command()
@click.option("--target", required=True, help="Target folder with tokenizer (bench/gpu_setup.py target).")
@click.option("--gpu", default=0, help="-1: CPU (smoke test).")
@click.option("--batches", default="1,16,64", help="Batch sizes (comma-separated).")
@click.option("--new-tokens", default=64, help="Tokens decoded per row (exactly: min = max).")
def main(target, gpu, batches, new_tokens) -> None:
    """Time generation the way --regenerate runs it."""
    from transformers import AutoTokenizer

    from dflash.decoding.greedy import greedy_generate
    from dflash.producers.target import load_target, resolve_device

    device = resolve_device(gpu if gpu >= 0 else None, "cpu" if gpu < 0 else None)
    t = load_target(target, device=device, full=True)
    tok = AutoTokenizer.from_pretrained(target)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    sizes = [int(b) for b in batches.split(",")]
    prompts = _prompts(tok, max(sizes))
    base = {"target": target, "attn_loaded": t.info.attn_impl, "dtype": t.info.dtype, "new_tokens": new_tokens}
    with t.lock, t.attention("sdpa"), torch.inference_mode():
        for b in sizes:
            ids, att = _left_pad(prompts[:b], pad, device)
            rows = prompts[:b]
            _generate(t.model, ids, att, pad, 4)  # warm-up: kernels, allocator
            greedy_generate(t.model, rows, max_new_tokens=4, stop_ids=set(), batch_size=len(rows))
            runs = {"generate": lambda: _generate(t.model, ids, att, pad, new_tokens),
                    "loop": lambda: greedy_generate(t.model, rows, max_new_tokens=new_tokens, stop_ids=set(),
                                                    batch_size=len(rows))}
            for way, fn in runs.items():
                s = _timed(fn, device)
                print(json.dumps({**base, "batch": b, "prompt_width": ids.shape[1], "way": way,
                                  "ms_per_step": round(1000 * s / new_tokens, 2),
                                  "new_tok_per_s": round(b * new_tokens / s)}), flush=True)
            kw, pos, nxt = _prefilled(t.model, ids, att)
            def step():
                return t.model(input_ids=nxt, attention_mask=torch.cat([att, torch.ones_like(nxt)], 1),
                               position_ids=pos + 1, use_cache=True, **kw)
            s = min(_timed(step, device) for _ in range(5))  # the cache grows by one per call: harmless here
            print(json.dumps({**base, "batch": b, "way": "forward", "ms_per_step": round(1000 * s, 2)}), flush=True)


if __name__ == "__main__":
    main()
