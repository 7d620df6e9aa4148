"""The DFlash authors' reference decoding, run by bench/reference_tau.py in the reference's
own environment (the transformers version it pins). Imports nothing of this project.

Reads one JSON object on stdin: {"reference", "target", "drafter", "dtype", "threads",
"max_new_tokens", "stop_ids", "prompts": [{"name", "ids"}]}; writes one JSON object on
stdout: what the reference's transformers read from the two folders, and per prompt the
reference's `dflash_generate` output and acceptance lengths at the drafter's block size
and at block size 1 (its target-only baseline, as its benchmark runs it).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> None:
    job = json.load(sys.stdin)
    ref = Path(job["reference"]).resolve()
    sys.path.insert(0, str(ref))  # the reference package `dflash` (not this project's namespace)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    import dflash.model as ref_model

    if not Path(ref_model.__file__).resolve().is_relative_to(ref):
        sys.exit(f"imported dflash.model from {ref_model.__file__}, not from {ref}")
    # The reference times its decode with torch.cuda.synchronize(); on a CPU build that raises.
    # Only the timing helper is replaced, the decoding code runs as published.
    ref_model._cuda_time = time.perf_counter
    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[job["dtype"]]
    target = AutoModelForCausalLM.from_pretrained(job["target"], dtype=dtype).eval()
    draft, info = ref_model.DFlashDraftModel.from_pretrained(job["drafter"], dtype=dtype, output_loading_info=True)
    draft = draft.eval()
    bad = {k: v for k, v in info.items() if v}
    if bad:
        sys.exit(f"the reference did not load {job['drafter']} cleanly: {bad}")

    rows = []
    for p in job["prompts"]:
        ids = torch.tensor([p["ids"]], dtype=torch.long)
        out = {}
        for bs in (1, draft.block_size):
            r = ref_model.dflash_generate(draft, target=target, input_ids=ids, max_new_tokens=job["max_new_tokens"],
                                          stop_token_ids=job["stop_ids"], temperature=0.0, block_size=bs,
                                          return_stats=True)
            out[bs] = {"tokens": r.output_ids[0, ids.shape[1]:].tolist(),
                       "acceptance_lengths": [int(a) for a in r.acceptance_lengths]}
        rows.append({"name": p["name"], "greedy": out[1]["tokens"], "tokens": out[draft.block_size]["tokens"],
                     "acceptance_lengths": out[draft.block_size]["acceptance_lengths"]})
    tcfg = target.config
    json.dump({
        "transformers": transformers.__version__, "torch": torch.__version__,
        "target_rope_theta": getattr(tcfg, "rope_theta", None),
        "drafter_rope_theta": getattr(draft.config, "rope_theta", None),
        "drafter_dtype": str(next(draft.parameters()).dtype).removeprefix("torch."),
        "block_size": draft.block_size, "mask_token_id": draft.mask_token_id,
        "target_layer_ids": list(draft.target_layer_ids), "attn_implementation": draft.config._attn_implementation,
        "prompts": rows,
    }, sys.stdout)


if __name__ == "__main__":
    main()
