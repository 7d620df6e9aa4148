"""The producer's one frozen config; the click command in cli.py only maps options onto it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflash.runtime.command_line import DEFAULT_BROKER

DEFAULT_REGEN_CACHE = str(Path.home() / ".cache" / "dflash" / "regen")
DROPPABLE = ("repetition", "cap")  # answer endings --regen-drop may name (decoding/endings.py REASONS)


@dataclass(frozen=True)
class ProducerConfig:
    target: str
    data: str
    broker: str = DEFAULT_BROKER
    gpu: int | None = None
    device: str | None = None
    dtype: str = "auto"
    attn_impl: str = "auto"
    target_layers: str | None = None
    token_budget: int = 16384
    max_batch_size: int = 16  # also the drafter's sequences per step (docs/TRAINING.md "Steps")
    max_length: int = 3072
    lease_size: int = 256
    prefetch: int = 4
    skip_bad_rows: bool = False
    regenerate: bool = False
    max_new_tokens: int = 1024
    regen_batch_size: int = 0  # the most rows at once; 0: 2048 on a GPU (producers/regenerate.py kv_plan)
    regen_cache: str = DEFAULT_REGEN_CACHE
    regen_ahead: int = 8192  # several times a decoder's rows, so the look-ahead keeps them all decoding
    regen_loops: bool = True  # a looping answer stops early and is cut (decoding/endings.py)
    regen_drop: str = "none"  # answer endings whose rows are skipped and reported, not trained
    chat_template_kwargs: str = "{}"
    hidden_encoding: str = "raw"
    final_hidden: bool = False  # also send the final-norm output (the consumer's --distill-weight needs it)
    check_packing: bool = True
    trust_remote_code: bool = False
    tensor_parallel: bool = False  # one producer over the processes of a torchrun launch (producers/shard.py)
    instance: str | None = None
    runs_dir: str | None = None
    log_level: str = "info"
    dry_run: bool = False
    limit: int | None = None
    curve_keys: str | None = None  # CurveZMQ: keys folder (dflash-keygen), None = plain TCP
    curve_name: str | None = None

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
