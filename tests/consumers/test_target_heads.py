"""A consumer reads embed_tokens and lm_head of the target, and nothing else."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.harness.tiny import tiny_target
from dflash.runtime.target_heads import TargetLoadError, load_target_heads

pytestmark = pytest.mark.unit


def _reference(folder):
    """All tensors of a checkpoint, read before anything is broken."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_sharded_target_loads_with_every_other_shard_missing_or_corrupt(tmp_path):
    folder = tiny_target(tmp_path / "t", layers=4, max_shard_size="60KB")
    ref = _reference(folder)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    needed = {weight_map["model.embed_tokens.weight"], weight_map["lm_head.weight"]}
    others = sorted(set(weight_map.values()) - needed)
    assert len(others) >= 2, "the tiny target must spread its layers over other shards"
    (folder / others[0]).unlink()  # missing
    for name in others[1:]:
        (folder / name).write_bytes(b"\xff" * 64)  # not even a valid safetensors header

    heads = load_target_heads(folder)
    assert torch.equal(heads.embed, ref["model.embed_tokens.weight"])
    assert torch.equal(heads.lm_head, ref["lm_head.weight"])
    assert heads.spec.hidden_size == 64 and heads.spec.num_hidden_layers == 4 and heads.spec.vocab_size == 512
    assert not heads.embed.requires_grad and not heads.lm_head.requires_grad


def test_single_file_target_with_corrupt_layer_bytes_still_gives_exact_heads(tmp_path):
    folder = tiny_target(tmp_path / "t")
    ref = _reference(folder)
    f = folder / "model.safetensors"
    raw = bytearray(f.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    for name, info in header.items():
        if name.startswith("model.layers."):  # scribble over every decoder tensor's data
            a, b = info["data_offsets"]
            raw[8 + header_len + a : 8 + header_len + b] = b"\x7f" * (b - a)
    f.write_bytes(bytes(raw))
    heads = load_target_heads(folder, dtype=torch.bfloat16)
    assert heads.embed.dtype == torch.bfloat16
    assert torch.equal(heads.embed, ref["model.embed_tokens.weight"].to(torch.bfloat16))
    assert torch.equal(heads.lm_head, ref["lm_head.weight"].to(torch.bfloat16))


def test_tied_embeddings_use_the_embedding_as_lm_head(tmp_path):
    folder = tiny_target(tmp_path / "t", tie=True)
    assert "lm_head.weight" not in _reference(folder)  # transformers drops the tied copy
    heads = load_target_heads(folder)
    assert heads.lm_head is heads.embed


def test_identity_tells_targets_apart_but_not_dtypes(tmp_path):
    a = load_target_heads(tiny_target(tmp_path / "a", seed=0))
    b = load_target_heads(tiny_target(tmp_path / "b", seed=1))
    a16 = load_target_heads(tmp_path / "a", dtype=torch.bfloat16)
    assert a.identity != b.identity
    assert a.identity == a16.identity


def test_missing_pieces_are_named(tmp_path):
    with pytest.raises(TargetLoadError, match="config.json"):
        load_target_heads(tmp_path)
    folder = tiny_target(tmp_path / "t", layers=4, max_shard_size="60KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    (folder / index["weight_map"]["lm_head.weight"]).unlink()
    with pytest.raises(TargetLoadError, match="lm_head.weight"):
        load_target_heads(folder)
