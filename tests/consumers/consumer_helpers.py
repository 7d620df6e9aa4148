"""Tiny real targets and hand-made batches for the consumer tests (no mocks, no network)."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash.consumers.batch import Batch
from dflash.consumers.synthetic import rule_batch  # noqa: F401  (the learnable stream, shared with the CLI)
from dflash.consumers.target_heads import TargetSpec
from dflash.protocol import codec
from dflash.protocol.fp8 import ENCODING, encode_fp8
from dflash.protocol.messages import header

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
    return Batch(
        batch_id=batch_id,
        samples=list(range(sample_start, sample_start + len(seq_lens))),
        seq_lens=list(seq_lens),
        layer_ids=list(layer_ids),
        epoch=epoch,
        input_ids=torch.randint(0, 500, (T,), generator=g, dtype=torch.int32),
        loss_mask=mask,
        hidden=torch.randn(T, len(layer_ids) * spec.hidden_size, generator=g),
    )


def batch_message(b: Batch, fp8: bool = False, run: str = "20261129T000000Z-abcd") -> codec.Message:
    """`b` as a consumer receives it: encoded with the real codec (bf16, or fp8 with row
    scales) and decoded again, so its tensors are read-only views of the frames."""
    fields = dict(batch_id=b.batch_id, producer="p1", lease=0, epoch=b.epoch, samples=b.samples,
                  seq_lens=b.seq_lens, layer_ids=b.layer_ids)
    tensors = {"input_ids": b.input_ids, "loss_mask": b.loss_mask}
    if fp8:
        q, scale = encode_fp8(b.hidden, len(b.layer_ids))
        tensors.update(hidden=q, hidden_scale=scale)
        fields["hidden_encoding"] = ENCODING
    else:
        tensors["hidden"] = b.hidden.to(torch.bfloat16)
    frames = [bytes(f) for f in codec.encode(header("batch", run, **fields), tensors)]
    return codec.decode(frames)
