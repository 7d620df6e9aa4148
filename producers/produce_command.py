"""dflash-produce's command line: the options, made into the frozen `ProducerConfig`, then
handed to producer_process.run. torch is imported only once the options are read (the
process and what it imports need it), so that `--help` answers at once.

    python -m dflash.producers.produce_command --target Qwen/Qwen3-8B --data chats.jsonl
"""

from __future__ import annotations

import os

import click

from dflash.runtime.command_line import (broker_option, command, config_option, curve_options, fail,
                                    log_level_option, option, runs_dir_option, target_option)

from .producer_config import DEFAULT_REGEN_CACHE, ProducerConfig


@command("PRODUCE")
@config_option()
@broker_option()
@runs_dir_option()
@target_option("Target model: a local folder, a Hugging Face hub ID, or a .gguf file (de-quantised to --dtype by "
              "transformers; needs the gguf extra).")
@option("--data", required=True, help="Dataset: .jsonl (messages / conversations / text rows), "
        ".parquet, or a HF datasets folder (save_to_disk).")
@option("--gpu", type=int, default=None, help="GPU index to run the target on (default: GPU 0 if any, else CPU).")
@option("--device", default=None, help="Explicit torch device instead of --gpu, e.g. 'cpu' or 'cuda:1'.")
@option("--dtype", default="auto", type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
        help="Model dtype; auto = bfloat16 on GPU, float32 on CPU. Hidden states travel in it.")
@option("--attn-impl", default="auto", help="Attention implementation (sdpa, eager, flash_attention_2, "
        "flex_attention); auto = the first this model supports that packs correctly (start-up check): on GPU "
        "flash_attention_2 when installed, flex_attention, sdpa, eager; on CPU sdpa, eager, flex_attention; where "
        "none does, one sequence per forward pass, with a warning.")
@option("--target-layers", default=None, help="Comma-separated decoder layer IDs to capture (0-based, "
        "'layer i' = HF hidden_states[i+1]); default: 5 spaced from 1 to L-3, e.g. 1,9,17,25,33 for 36 layers.")
@option("--token-budget", type=int, default=16384, help="Max tokens per forward pass (packed, no padding); "
        "at least --max-length (lower both together, e.g. --token-budget 2048 --max-length 2048).")
@option("--max-batch-size", type=int, default=16, help="Max sequences per forward pass, and so per drafter "
        "step: short chats (a small target's) would otherwise make few, huge optimizer steps, which train a "
        "drafter far slower per sample (docs/TRAINING.md \"Steps\").")
@option("--max-length", type=int, default=3072, help="Sequences are truncated to this many tokens; at most "
        "--token-budget.")
@option("--lease-size", type=int, default=256, help="Samples asked of the broker per lease.")
@option("--prefetch", type=int, default=4, help="Batches prepared ahead of the GPU (the heartbeat's q_pre).")
@option("--skip-bad-rows", is_flag=True, default=False, help="Skip malformed rows (each logged, counted and "
        "reported to the broker) instead of stopping with an error naming file:line.")
@option("--regenerate", is_flag=True, default=False, help="Replace assistant turns by the target's own greedy "
        "generation before capture, trained as the exact token IDs generated (loss on those only); cached on disk "
        "per dataset, target and settings.")
@option("--max-new-tokens", type=int, default=1024, help="Generation length limit per turn with --regenerate.")
@option("--regen-batch-size", type=int, default=0, help="The most rows decoded side by side with --regenerate "
        "(continuous batching) on a paged KV cache of 40% of the GPU's memory; how many decode at once is set by "
        "the pages their own prompts and answers fill. 0: at most 2048 (16 on a CPU); any number: at most that many.")
@option("--regen-cache", default=DEFAULT_REGEN_CACHE, help="Folder of the regeneration cache (SQLite files).")
@option("--regen-ahead", type=int, default=8192, help="With --regenerate: rows of the run's order a regeneration "
        "thread may make ahead of the furthest leased row (rows already cached do not count), decoding "
        "continuously while ready rows are captured (producers/regen_ahead.py); 0: regenerate each lease's rows "
        "when it comes, all before its first batch.")
@option("--regen-loops/--no-regen-loops", default=True, help="With --regenerate: an answer whose last tokens "
        "repeat one block (period up to 64 tokens, at least 64 tokens and 3 copies) stops there and is cut after "
        "the block's first copy (decoding/endings.py), instead of looping to --max-new-tokens.")
@option("--regen-drop", default="none", help="With --regenerate: answer endings whose rows are not trained "
        "but skipped and reported to the broker (counted per reason): a comma-separated list of repetition (a loop "
        "was cut), cap (--max-new-tokens reached, unfinished), or none.")
@option("--chat-template-kwargs", default="{}", help="JSON object passed to the chat template, "
        "e.g. '{\"enable_thinking\": false}'.")
@option("--hidden-encoding", default="raw", type=click.Choice(["raw", "fp8_e4m3_rowscale"]),
        help="Wire encoding of hidden states: raw (model dtype) or fp8 with per-row scales (half of bf16).")
@option("--final-hidden", is_flag=True, default=False, help="Also send each token's last hidden state after the "
        "final norm (the LM head's input, H values per token): consumers with --distill-weight compute the "
        "target's next-token distribution from it (docs/TRAINING.md \"Distillation\").")
@option("--check-packing/--no-check-packing", default=True, help="At start, verify that packed sequences "
        "do not attend to each other on this model (a few tiny forward passes).")
@option("--trust-remote-code", is_flag=True, default=False, help="Allow model code from the checkpoint.")
@option("--tensor-parallel", is_flag=True, default=False, help="One producer over all processes of a torchrun "
        "launch (torchrun --nproc-per-node N -m dflash.producers.produce_command --tensor-parallel ...): the target is sharded "
        "by transformers' tensor parallelism (tp_plan auto; NCCL on GPUs, gloo on CPU), rank 0 talks to the broker, "
        "the other ranks follow its forward passes (docs/SHARDING.md).")
@option("--instance", default=None, help="This producer's name, unique among the run's live producers (default <host>-<device>-<pid>, "
        "e.g. node1-cuda0-4711).")
@log_level_option()
@option("--dry-run", is_flag=True, default=False, help="No broker: one pass over the local dataset, batches "
        "discarded, summary printed.")
@option("--limit", type=int, default=None, help="With --dry-run: only the first N samples.")
@curve_options
def main(**kw) -> None:
    """Run a frozen target model on leased samples and stream hidden states to the broker."""
    cfg = ProducerConfig(**kw)
    try:  # options that cannot work together are refused now, not after torch and the target load
        cfg.check()
    except ValueError as e:
        fail(str(e))
    if not cfg.dry_run and (not cfg.tensor_parallel or os.environ.get("RANK", "0") == "0"):
        from dflash.protocol.peer import dial_or_exit

        dial_or_exit(cfg.broker, cfg.curve_keys, cfg.curve_name)  # a wrong --broker said before the target loads
    from .producer_process import run

    run(cfg)


if __name__ == "__main__":
    main()
