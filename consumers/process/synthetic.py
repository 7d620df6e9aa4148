"""A local batch source for runs without producers: smoke tests, throughput checks, demos.

The stream is learnable, so a healthy drafter shows falling loss: each sequence steps by a
hidden stride that only the context's target features carry (a random code of it)."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import torch

from dflash.protocol.batch import Batch
from dflash.runtime.target_heads import TargetSpec


def rule_batch(
    spec: TargetSpec, layer_ids: list[int], *, seed: int, n_seqs: int = 4, seq_len: int = 40, prompt: int = 6,
    modulus: int = 16, max_stride: int = 3, base: int = 100, batch_id: str = "r0", sample_start: int = 0,
    epoch: int = 0, dtype: torch.dtype = torch.float32,
) -> Batch:
    """One packed batch of `n_seqs` sequences of the stride stream (tokens base..base+modulus-1)."""
    if base + modulus > spec.vocab_size:
        raise ValueError(f"tokens {base}..{base + modulus - 1} exceed the vocabulary ({spec.vocab_size})")
    g = torch.Generator().manual_seed(seed)
    width = len(layer_ids) * spec.hidden_size
    codes = torch.Generator().manual_seed(7)  # the same code tables for every batch
    stride_code = torch.randn(max_stride + 1, width, generator=codes)  # [S+1, n*D]
    token_code = 0.1 * torch.randn(modulus, width, generator=codes)  # [m, n*D]
    strides = torch.randint(1, max_stride + 1, (n_seqs,), generator=g)  # [n]
    start = torch.randint(0, modulus, (n_seqs,), generator=g)  # [n]
    t = torch.arange(seq_len)
    offs = (start[:, None] + strides[:, None] * t[None, :]) % modulus  # [n, L]
    hidden = stride_code[strides][:, None, :] + token_code[offs]  # [n, L, n*D]
    mask = torch.ones(n_seqs, seq_len, dtype=torch.uint8)
    mask[:, :prompt] = 0
    return Batch.packed(list(range(sample_start, sample_start + n_seqs)), [seq_len] * n_seqs,
                        (base + offs).flatten().to(torch.int32), mask.flatten(),
                        hidden.reshape(n_seqs * seq_len, width).to(dtype), batch_id=batch_id, epoch=epoch,
                        layer_ids=layer_ids)


def synthetic_stream(
    spec: TargetSpec, layer_ids: list[int], *, batches: int, n_seqs: int, seq_len: int, rank: int = 0,
    seed: int = 0, dtype: torch.dtype = torch.bfloat16,
) -> Iterator[Batch]:
    """`batches` batches for this rank; sample IDs never repeat across ranks or batches."""
    for i in range(batches):
        first = (i * 1024 + rank) * n_seqs  # disjoint per (batch, rank) for up to 1024 ranks
        yield rule_batch(spec, layer_ids, seed=seed * 1_000_003 + first, n_seqs=n_seqs, seq_len=seq_len,
                         prompt=min(6, seq_len // 4), batch_id=f"synthetic-{rank}-{i}", sample_start=first,
                         dtype=dtype)


def as_received(b: Batch, fp8: bool = False, run: str = "20261129T000000Z-local") -> Batch:
    """`b` through the real codec and back, as a link reads it (read-only frame views), for tests."""
    from dflash.protocol import codec
    from dflash.protocol.fp8 import ENCODING as ENCODING
    from dflash.protocol.fp8 import encode_fp8

    tensors = {"input_ids": b.input_ids, "loss_mask": b.loss_mask}
    encoding = None
    if fp8:
        q, scale = encode_fp8(b.hidden, len(b.layer_ids))
        tensors.update(hidden=q, hidden_scale=scale)
        encoding = ENCODING
    else:
        tensors["hidden"] = b.hidden.to(torch.bfloat16)
    sent = replace(b, producer=b.producer or "p1", hidden_encoding=encoding, tensors=tensors)
    return codec.decode_batch([bytes(f) for f in codec.encode_batch(sent, run)], run=run)
