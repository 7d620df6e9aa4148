"""Our dflash-eval decoding against the DFlash authors' reference code, same drafter, same
target, same prompt token IDs, same dtype.

    python bench/reference_tau.py --reference /tmp/zlab-dflash --python /venv-4.57.1/bin/python \\
        --drafter EXPORT --target TARGET --prompts PROMPTS.jsonl [--max-new-tokens 64] [--limit 6]

--reference is a checkout of z-lab/dflash (its `dflash/model.py` is used unchanged);
--python is an interpreter with the transformers version that package pins (it runs
bench/reference_worker.py, which imports nothing of this project). Our side is
dflash-eval's path: tools/eval.py `load_pair` (the export loader), `read_prompts` and
`stop_ids` (consumers/evaluation/evaluate.py), consumers/evaluation/speculative.py `speculative_greedy` and target-only `greedy`.

Prints per prompt and overall: both taus (mean of per-prompt means, as the reference's
benchmark reports it, and pooled over cycles), whether both decodings are lossless,
whether the two sides produced the same tokens, and how many cycles agree exactly.

The target folder: transformers 5 saves `rope_parameters` and no top-level `rope_theta`;
transformers 4.x does not read `rope_parameters` and silently falls back to the default
rope_theta (10000), i.e. decodes another model than the one the drafter was trained on.
Unless --raw-target-config, the reference therefore gets a view of the target folder
(links to the same files) whose config.json also carries the top-level keys 4.x reads.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import click
import torch

WORKER = Path(__file__).with_name("reference_worker.py")


def legacy_rope_view(target: Path, into: Path) -> tuple[Path, dict]:
    """`target` as transformers 4.x reads it: a folder of links to its files, config.json
    with `rope_theta` (and `rope_scaling`) at the top level from `rope_parameters`.
    Returns (folder, keys added); `target` itself when nothing needs adding."""
    raw = json.loads((target / "config.json").read_text())
    added: dict = {}
    for cfg in (raw, raw.get("text_config")):
        rope = (cfg or {}).get("rope_parameters")
        if not rope or "rope_theta" in cfg:
            continue
        cfg["rope_theta"] = added["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = added["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if not added:
        return target, {}
    into.mkdir(parents=True)
    for f in target.iterdir():
        if f.name != "config.json":
            (into / f.name).symlink_to(f.resolve())
    (into / "config.json").write_text(json.dumps(raw, indent=2))
    return into, added


def run_reference(python: str, job: dict) -> dict:
    proc = subprocess.run([python, str(WORKER)], input=json.dumps(job), capture_output=True, text=True)
    if proc.returncode != 0:
        raise click.ClickException(f"the reference worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


def common_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(ours: list[dict], ref: list[dict]) -> dict:
    rows = []
    for o, r in zip(ours, ref):
        n = min(len(o["tokens"]), len(r["tokens"]))
        rows.append({
            "prompt": o["name"], "new_tokens": [len(o["tokens"]), len(r["tokens"])],
            "tau": [mean(o["acceptance_lengths"]), mean(r["acceptance_lengths"])],
            "cycles": [len(o["acceptance_lengths"]), len(r["acceptance_lengths"])],
            # Cycles that committed the same number of tokens, from the first on (the last one
            # or two differ by construction: ours caps the block at max_new_tokens, the
            # reference drafts a full block past it and cuts the output afterwards).
            "same_cycles": common_prefix(o["acceptance_lengths"], r["acceptance_lengths"]),
            "lossless": [o["tokens"] == o["greedy"], r["tokens"] == r["greedy"]],
            "same_target_output": o["greedy"][:n] == r["greedy"][:n],
            "same_output": o["tokens"][:n] == r["tokens"][:n],
        })
    def pooled(side):
        return [a for p in side for a in p["acceptance_lengths"]]
    tau_o, tau_r = mean([x["tau"][0] for x in rows]), mean([x["tau"][1] for x in rows])
    return {
        "tau": {"ours": tau_o, "reference": tau_r,
                "relative_difference": round(abs(tau_o - tau_r) / tau_r, 4) if tau_r else None},
        "tau_pooled": {"ours": mean(pooled(ours)), "reference": mean(pooled(ref))},
        "all_lossless": all(all(x["lossless"]) for x in rows),
        "all_same_output": all(x["same_output"] for x in rows),
        "all_same_target_output": all(x["same_target_output"] for x in rows),
        "per_prompt": rows,
    }


@click.command(context_settings={"max_content_width": 100})
@click.option("--reference", required=True, type=click.Path(exists=True, file_okay=False),
              help="Folder of the reference package (a z-lab/dflash checkout: dflash/model.py).")
@click.option("--python", "python", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Python with the transformers version the reference pins.")
@click.option("--drafter", required=True, type=click.Path(exists=True, file_okay=False), help="dflash-export folder.")
@click.option("--target", required=True, type=click.Path(exists=True, file_okay=False), help="Target model folder.")
@click.option("--prompts", required=True, type=click.Path(exists=True, dir_okay=False), help="JSON Lines prompts.")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(1))
@click.option("--limit", default=None, type=click.IntRange(1), help="First N prompts only.")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16"]))
@click.option("--threads", default=None, type=click.IntRange(1), help="torch CPU threads on both sides.")
@click.option("--raw-target-config", is_flag=True, default=False,
              help="Give the reference the target folder as is (no top-level rope_theta added).")
@click.option("--json", "as_json", is_flag=True, default=False, help="Print the full comparison as JSON.")
def main(reference, python, drafter, target, prompts, max_new_tokens, limit, dtype, threads, raw_target_config,
         as_json) -> None:
    """tau of DRAFTER on TARGET in dflash-eval's decoding and in the reference's dflash_generate."""
    from dflash.consumers.evaluation.speculative import greedy, speculative_greedy
    from dflash.consumers.evaluation.evaluate import read_prompts, stop_ids
    from dflash.tools.eval import load_pair

    if threads:
        torch.set_num_threads(threads)
    model, tok, d = load_pair(target, drafter, dtype, "cpu")
    rows = read_prompts(prompts, tok, limit)
    stops = stop_ids(model, tok)
    ours = []
    for p in rows:
        ids = torch.tensor(p.ids)
        spec = speculative_greedy(model, d, ids, max_new_tokens, stops)
        ours.append({"name": p.name, "tokens": spec.tokens, "acceptance_lengths": spec.accept_lengths,
                     "greedy": greedy(model, ids, max_new_tokens, stops).tokens})
    rope = getattr(model.config, "rope_parameters", None) or {}
    our_theta = rope.get("rope_theta", getattr(model.config, "rope_theta", None))

    with tempfile.TemporaryDirectory() as tmp:
        ref_target, added = (Path(target), {}) if raw_target_config else legacy_rope_view(Path(target), Path(tmp) / "t")
        job = {"reference": str(Path(reference).resolve()), "target": str(ref_target), "drafter": str(drafter),
               "dtype": dtype, "threads": threads, "max_new_tokens": max_new_tokens, "stop_ids": sorted(stops),
               "prompts": [{"name": p.name, "ids": p.ids} for p in rows]}
        ref = run_reference(python, job)
    out = compare(ours, ref["prompts"])
    out["setup"] = {"max_new_tokens": max_new_tokens, "dtype": dtype, "prompts": len(rows),
                    "block_size": d.block_size, "stop_ids": sorted(stops),
                    "target_rope_theta": {"ours": our_theta, "reference": ref["target_rope_theta"]},
                    "drafter_rope_theta": {"ours": d.model.cfg.rope_theta, "reference": ref["drafter_rope_theta"]},
                    "added_for_reference": added, "reference_transformers": ref["transformers"],
                    "reference_drafter_dtype": ref["drafter_dtype"]}
    if as_json:
        click.echo(json.dumps(out))
        return
    s = out["setup"]
    click.echo(f"reference transformers {s['reference_transformers']}; target rope_theta ours "
               f"{s['target_rope_theta']['ours']} reference {s['target_rope_theta']['reference']}"
               + (f" (added for the reference: {added})" if added else ""))
    click.echo(f"{'prompt':<24} {'new':>9} {'cycles':>9} {'same':>5} {'tau ours':>9} {'tau ref':>8}  lossless  same-out")
    for r in out["per_prompt"]:
        click.echo(f"{r['prompt'][:24]:<24} {r['new_tokens'][0]:>4}/{r['new_tokens'][1]:<4} "
                   f"{r['cycles'][0]:>4}/{r['cycles'][1]:<4} {r['same_cycles']:>5} {r['tau'][0]:>9.3f} "
                   f"{r['tau'][1]:>8.3f}  {'/'.join('yes' if x else 'NO' for x in r['lossless']):>8}  "
                   f"{'yes' if r['same_output'] else 'NO'}")
    t = out["tau"]
    click.echo(f"overall tau (mean of prompts): ours {t['ours']} reference {t['reference']} "
               f"(difference {t['relative_difference']:.1%}); pooled ours {out['tau_pooled']['ours']} "
               f"reference {out['tau_pooled']['reference']}; lossless {out['all_lossless']}, same output "
               f"{out['all_same_output']}, same target output {out['all_same_target_output']}")
    if not out["all_same_target_output"]:
        click.echo("warning: the two sides' target-only greedy outputs differ: they are not decoding the same "
                   "target (see target_rope_theta)", err=True)


if __name__ == "__main__":
    main()
