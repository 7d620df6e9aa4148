"""Tiny real targets and hand-made batches (no mocks, no network)."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash.protocol.batch import Batch
from dflash.consumers.process.synthetic import as_received, rule_batch  # noqa: F401  (the learnable stream, shared with the CLI)
from dflash.runtime.target_heads import TargetSpec

MASK_ID = 511  # an unused row of the tiny vocabulary


def tiny_target(path: Path, *, tie: bool = False, layers: int = 4, seed: int = 0, **shard) -> Path:
    """A real (tiny) Qwen3 causal LM saved the way Hugging Face saves real ones."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=tie,
        initializer_range=0.5,  # LM-head logits on the scale of a trained model's
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(path, **shard)
    return path


def tiny_dir(family: str, tie: bool, **kw):
    """The product's tiny target of `family` (dflash.tools.tiny: cached, with a tokenizer)."""
    from dflash.tools.tiny import tiny_target

    return tiny_target(family=family, tie=tie, **kw)


def random_batch(
    spec: TargetSpec, layer_ids: list[int], seq_lens: list[int], *, seed: int, batch_id: str = "b0",
    sample_start: int = 0, epoch: int = 0, prompt: int = 4,
) -> Batch:
    """Random tokens and features; the first `prompt` tokens of each sequence are prompt."""
    g = torch.Generator().manual_seed(seed)
    T = sum(seq_lens)
    mask = torch.ones(T, dtype=torch.uint8)
    start = 0
    for L in seq_lens:
        mask[start : start + min(prompt, L)] = 0
        start += L
    return Batch.packed(
        list(range(sample_start, sample_start + len(seq_lens))),
        seq_lens,
        torch.randint(0, 500, (T,), generator=g, dtype=torch.int32),
        mask,
        torch.randn(T, len(layer_ids) * spec.hidden_size, generator=g),
        batch_id=batch_id,
        layer_ids=layer_ids,
        epoch=epoch,
    )


def batch_message(b: Batch, fp8: bool = False, run: str = "20261129T000000Z-abcd") -> Batch:
    """`b` as a consumer receives it (consumers.process.synthetic.as_received): read-only frame views."""
    return as_received(b, fp8, run)
