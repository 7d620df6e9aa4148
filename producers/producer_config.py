"""The producer's one frozen config, each field the dflash-produce option of its name (its
default, help and type declared once, here); produce_command.py makes the command from it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import click

from dflash.runtime.command_line import (broker_setting, curve_keys_setting, curve_name_setting, log_level_setting,
                                         runs_dir_setting, setting, target_setting)

DEFAULT_REGEN_CACHE = str(Path.home() / ".cache" / "dflash" / "regen")
DROPPABLE = ("repetition", "cap")  # answer endings --regen-drop may name (decoding/endings.py REASONS)


@dataclass(frozen=True, kw_only=True)
class ProducerConfig:
    """The producer's settings; each field is the dflash-produce option of its name, in --help order."""

    broker: str = broker_setting()
    runs_dir: str = runs_dir_setting()
    target: str = target_setting("Target model: a local folder, a Hugging Face hub ID, or a .gguf file (de-quantised "
                                 "to --dtype by transformers; needs the gguf extra).")
    data: str = setting(required=True, help="Dataset: .jsonl (messages / conversations / text rows), "
                        ".parquet, or a HF datasets folder (save_to_disk).")
    gpu: int | None = setting(None, help="GPU index to run the target on (default: GPU 0 if any, else CPU).")
    device: str | None = setting(None, help="Explicit torch device instead of --gpu, e.g. 'cpu' or 'cuda:1'.")
    dtype: str = setting("auto", type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
                         help="Model dtype; auto = bfloat16 on GPU, float32 on CPU. Hidden states travel in it.")
    attn_impl: str = setting(
        "auto", help="Attention implementation (sdpa, eager, flash_attention_2, flex_attention); auto = the first this "
        "model supports that packs correctly (start-up check): on GPU flash_attention_2 when installed, flex_attention, "
        "sdpa, eager; on CPU sdpa, eager, flex_attention; where none does, one sequence per forward pass, with a warning.")
    target_layers: str | None = setting(
        None, help="Comma-separated decoder layer IDs to capture (0-based, 'layer i' = HF hidden_states[i+1]); default: "
        "5 spaced from 1 to L-3, e.g. 1,9,17,25,33 for 36 layers.")
    token_budget: int = setting(16384, help="Max tokens per forward pass (packed, no padding); at least --max-length "
                                "(lower both together, e.g. --token-budget 2048 --max-length 2048).")
    max_batch_size: int = setting(  # also the drafter's sequences per step (docs/TRAINING.md "Steps")
        16, help="Max sequences per forward pass, and so per drafter step: short chats (a small target's) would "
        "otherwise make few, huge optimizer steps, which train a drafter far slower per sample (docs/TRAINING.md "
        "\"Steps\").")
    max_length: int = setting(3072, help="Sequences are truncated to this many tokens; at most --token-budget.")
    lease_size: int = setting(256, help="Samples asked of the broker per lease.")
    prefetch: int = setting(4, help="Batches prepared ahead of the GPU (the heartbeat's q_pre).")
    skip_bad_rows: bool = setting(False, help="Skip malformed rows (each logged, counted and reported to the broker) "
                                  "instead of stopping with an error naming file:line.")
    regenerate: bool = setting(
        False, help="Replace assistant turns by the target's own greedy generation before capture, trained as the "
        "exact token IDs generated (loss on those only); cached on disk per dataset, target and settings.")
    max_new_tokens: int = setting(1024, help="Generation length limit per turn with --regenerate.")
    regen_batch_size: int = setting(  # 0: 2048 on a GPU (producers/regenerate.py kv_plan)
        0, help="The most rows decoded side by side with --regenerate (continuous batching) on a paged KV cache of 40% "
        "of the GPU's memory; how many decode at once is set by the pages their own prompts and answers fill. 0: at "
        "most 2048 (16 on a CPU); any number: at most that many.")
    regen_cache: str = setting(DEFAULT_REGEN_CACHE, help="Folder of the regeneration cache (SQLite files).")
    regen_ahead: int = setting(  # several times a decoder's rows, so the look-ahead keeps them all decoding
        8192, help="With --regenerate: rows of the run's order a regeneration thread may make ahead of the furthest "
        "leased row (rows already cached do not count), decoding continuously while ready rows are captured "
        "(producers/regen_ahead.py); 0: regenerate each lease's rows when it comes, all before its first batch.")
    regen_loops: bool = setting(
        True, help="With --regenerate: an answer whose last tokens repeat one block (period up to 64 tokens, at least "
        "64 tokens and 3 copies) stops there and is cut (--regen-loop-keep; decoding/endings.py), instead of looping "
        "to --max-new-tokens.")
    regen_loop_keep: str = setting(  # the choices are decoding/endings.py KEEPS
        "span", type=click.Choice(["span", "copy"]), help="With --regen-loops: what of a looping answer is trained: "
        "span (the loop's start and the repeats that show it, 64 tokens or 3 copies: the target does repeat itself, "
        "and a drafter learns to predict the repeats) or copy (the repeated block once).")
    regen_drop: str = setting(
        "none", help="With --regenerate: answer endings whose rows are not trained but skipped and reported to the "
        "broker (counted per reason): a comma-separated list of repetition (a loop was cut), cap (--max-new-tokens "
        "reached, unfinished), or none.")
    chat_template_kwargs: str = setting(
        "{}", help="JSON object passed to the chat template, e.g. '{\"enable_thinking\": false}'.")
    hidden_encoding: str = setting(
        "raw", type=click.Choice(["raw", "fp8_e4m3_rowscale"]),
        help="Wire encoding of hidden states: raw (model dtype) or fp8 with per-row scales (half of bf16).")
    final_hidden: bool = setting(  # the consumer's --distill-weight needs it
        False, help="Also send each token's last hidden state after the final norm (the LM head's input, H values per "
        "token): consumers with --distill-weight compute the target's next-token distribution from it "
        "(docs/TRAINING.md \"Distillation\").")
    check_packing: bool = setting(
        True, help="At start, verify that packed sequences do not attend to each other on this model (a few tiny "
        "forward passes).")
    trust_remote_code: bool = setting(False, help="Allow model code from the checkpoint.")
    tensor_parallel: bool = setting(  # producers/shard.py
        False, help="One producer over all processes of a torchrun launch (torchrun --nproc-per-node N -m "
        "dflash.producers.produce_command --tensor-parallel ...): the target is sharded by transformers' tensor "
        "parallelism (tp_plan auto; NCCL on GPUs, gloo on CPU), rank 0 talks to the broker, the other ranks follow "
        "its forward passes (docs/SHARDING.md).")
    instance: str | None = setting(
        None, help="This producer's name, unique among the run's live producers (default <host>-<device>-<pid>, "
        "e.g. node1-cuda0-4711).")
    log_level: str = log_level_setting()
    dry_run: bool = setting(False, help="No broker: one pass over the local dataset, batches discarded, summary "
                            "printed.")
    limit: int | None = setting(None, help="With --dry-run: only the first N samples.")
    curve_keys: str | None = curve_keys_setting()  # None = plain TCP
    curve_name: str | None = curve_name_setting()

    def template_kwargs(self) -> dict:
        """`chat_template_kwargs` parsed. Raises ValueError if it is not a JSON object."""
        try:
            kw = json.loads(self.chat_template_kwargs or "{}")
        except json.JSONDecodeError as e:
            raise ValueError(f"--chat-template-kwargs is not valid JSON: {e}") from None
        if not isinstance(kw, dict):
            raise ValueError("--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
        return kw

    def drop(self) -> tuple[str, ...]:
        """`regen_drop` parsed: the ending reasons not trained. Raises ValueError."""
        reasons = tuple(sorted({v.strip() for v in self.regen_drop.split(",") if v.strip()} - {"none"}))
        bad = [r for r in reasons if r not in DROPPABLE]
        if bad:
            raise ValueError(f"--regen-drop {self.regen_drop!r}: {', '.join(bad)} is not an answer ending to drop "
                             f"(a comma-separated list of {', '.join(DROPPABLE)}, or none)")
        if "repetition" in reasons and not self.regen_loops:
            raise ValueError("--regen-drop repetition needs --regen-loops (without it no answer ends by repetition)")
        return reasons

    def check(self) -> None:
        """Cross-option sanity. Raises ValueError with a one-line reason."""
        if self.token_budget < 1 or self.max_batch_size < 1 or self.max_length < 1:
            raise ValueError("--token-budget, --max-batch-size and --max-length must be positive")
        if self.max_length > self.token_budget:
            raise ValueError(f"--max-length {self.max_length} exceeds --token-budget {self.token_budget}: "
                             "a full-length sequence would never fit in one forward pass")
        if self.regen_batch_size < 0:
            raise ValueError(f"--regen-batch-size {self.regen_batch_size}: 0 (sized by memory) or a number of rows")
        if self.regen_ahead < 0:
            raise ValueError(f"--regen-ahead {self.regen_ahead}: a count of rows, 0 or more")
        if self.lease_size < 1 or self.prefetch < 1:
            raise ValueError("--lease-size and --prefetch must be positive")
        if self.hidden_encoding not in ("raw", "fp8_e4m3_rowscale"):
            raise ValueError(f"--hidden-encoding {self.hidden_encoding!r}: raw or fp8_e4m3_rowscale")
        if self.limit is not None and not self.dry_run:
            raise ValueError("--limit only applies to --dry-run (the broker decides which samples to produce)")
        if self.tensor_parallel and self.regenerate:
            raise ValueError("--regenerate is not supported with --tensor-parallel (generation is not sharded): "
                             "regenerate with a producer that holds the whole target, the cache is shared")
        if self.tensor_parallel and self.gpu is not None:
            raise ValueError("--tensor-parallel takes no --gpu: each rank runs on cuda:LOCAL_RANK (choose the GPUs "
                             "with CUDA_VISIBLE_DEVICES), or give --device cpu")
        self.template_kwargs()
        self.drop()
