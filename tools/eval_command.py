"""dflash-eval's command line: the options, parsed before torch is imported (the work is
tools/eval.py's `run`), so that `--help` answers at once."""

from __future__ import annotations

import click

from dflash.runtime.command_line import command, option, runs_dir_option, target_option


@command("EVAL", max_content_width=100)
@target_option("Target model folder (Hugging Face layout) or .gguf file.")
@option("--drafter", required=True,
        help="Drafter: a dflash-export folder (published layout), or a training checkpoint as dflash-export takes "
        "it: a step folder, run folder, run ID or 'latest'.")
@runs_dir_option()
@option("--prompts", required=True, type=click.Path(exists=True, dir_okay=False), help="JSON Lines file of prompts.")
@option("--max-new-tokens", default=256, type=click.IntRange(1), help="Tokens to generate per prompt (fewer at a stop token).")
@option("--limit", default=None, type=click.IntRange(1), help="Evaluate only the first N prompts.")
@option("--device", default="cpu", help="Torch device for both models.")
@option("--dtype", default="float32", type=click.Choice(["float32", "bfloat16", "float16"]), help="Dtype of both models.")
@option("--threads", default=None, type=click.IntRange(1), help="torch CPU threads (default: torch's choice).")
@option("--tie-tolerance", default=None, type=float,
        help="bfloat16/float16: a first difference where both tokens are within this logit margin of the "
             "target's best counts as a tie-flip, not an error (default per dtype, docs/EVAL.md; float32 is exact).")
@option("--fuse", default="auto", type=click.Choice(["auto", "on", "off"]),
        help="Fuse the drafter's norms, RoPE and SwiGLU with torch.compile (auto: on a GPU with a C compiler); "
             "a speculative cycle then launches fewer kernels. Outputs are checked lossless either way.")
@option("--json", "as_json", is_flag=True, default=False, help="Print the full report as one JSON object.")
def main(target, drafter, runs_dir, prompts, max_new_tokens, limit, device, dtype, threads, tie_tolerance,
         fuse, as_json) -> None:
    """Speculative decoding (greedy) with TARGET and DRAFTER on PROMPTS: tau, speedup, lossless check."""
    from dflash.tools.eval import run

    run(target, drafter, runs_dir, prompts, max_new_tokens, limit, device, dtype, threads, tie_tolerance, as_json,
        fuse=fuse)


if __name__ == "__main__":
    main()
