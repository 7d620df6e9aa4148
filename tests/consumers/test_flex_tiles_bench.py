"""bench/flex_tiles.py counts the very tiles the consumer's flex block mask lists (it asserts
that itself), and what the tile-aligned block keys save: a small batch by hand."""

import json

import pytest
from click.testing import CliRunner

from tests.harness.bench_script import load

pytestmark = pytest.mark.unit


def test_flex_tiles_counts_the_masks_tiles_and_what_aligned_block_keys_save():
    r = CliRunner().invoke(load("flex_tiles").main, ["--seqs", "3", "--seq-len", "90", "--batches", "2"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    (first, second) = out["batches"]
    assert first["context"] == 270 and first["queries"] == 3 * (90 - 6 - 16 + 1) * 16  # every trainable anchor
    assert second["seq_len"] == 90 - 41
    assert 0 < out["useful"] < 1 and 0 < out["partial_share"] <= 1
    # 270 context keys are no multiple of 128: the layout's padding drops tiles, never adds any
    assert first["partial"] + first["full"] < first["unaligned"] and 0 < out["aligned_saves"] < 1
    assert out["useful_unaligned"] < out["useful"]
