"""The flex BlockMask built from tile bounds (blocks.py `_flex_block_mask`) against
torch's create_block_mask, which evaluates the element rule at every (query, key) pair:
the same full tiles, every tile with a visible key listed, and the same attention."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from dflash.consumers.drafter.blocks import FLEX_BLOCK, _flex_block_mask, _mask_mod, build_layout, sample_anchors

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")


def tiles(counts, indices) -> list[set[int]]:
    return [set(indices[0, 0, i, : int(counts[0, 0, i])].tolist()) for i in range(counts.shape[-1])]


def layout_of(seq_lens, block_size, n_anchors, every, seed):
    anchors = []
    for i, L in enumerate(seq_lens):
        mask = torch.ones(L, dtype=torch.bool)
        mask[: min(L, 7 + i % 5)] = False  # a prompt
        anchors.append(sample_anchors(mask, block_size, n_anchors, seed + i, every))
    return build_layout(seq_lens, anchors, block_size, CPU, "flex")


CASES = [  # seq_lens, block size, anchors, every
    ([300, 293, 17, 310, 256], 16, 64, 1),  # tiles spanning sequences, one too short for any anchor
    ([300, 293, 310], 16, 512, 3),
    ([128, 256, 128], 16, 512, 1),  # T a multiple of the tile
    ([301, 97, 250], 10, 40, 1),  # B does not divide the tile
    ([40], 8, 3, 1),  # fewer queries than one tile
    ([700], 16, 512, 1),  # one long sequence: full context tiles
]


@pytest.mark.parametrize("seq_lens,B,n,every", CASES)
def test_tile_bounds_give_torchs_block_mask(seq_lens, B, n, every):
    lay = layout_of(seq_lens, B, n, every, seed=3)
    K, Q = lay.context_keys, lay.num_queries
    assert K % FLEX_BLOCK == 0 and 0 <= K - lay.ctx_pos.shape[0] < FLEX_BLOCK  # block keys start a tile
    ours = _flex_block_mask(lay, CPU)
    ref = create_block_mask(_mask_mod(lay, CPU), None, None, Q, K + Q, device=CPU, BLOCK_SIZE=FLEX_BLOCK)
    full, ref_full = tiles(ours.full_kv_num_blocks, ours.full_kv_indices), tiles(ref.full_kv_num_blocks,
                                                                                 ref.full_kv_indices)
    part, ref_part = tiles(ours.kv_num_blocks, ours.kv_indices), tiles(ref.kv_num_blocks, ref.kv_indices)
    assert full == ref_full  # a tile marked full skips the element rule: it must be exactly torch's
    for i, (p, rp, f) in enumerate(zip(part, ref_part, full)):
        assert rp <= p, f"query tile {i}: key tiles {sorted(rp - p)} with visible keys are missing"
        assert not (p & f)
    if sum(len(p) for p in ref_part) > 10:  # and not much more work than needed
        assert sum(len(p) for p in part) <= 2 * sum(len(p) for p in ref_part) + len(part)


@pytest.mark.parametrize("seq_lens,B,n,every", [([300, 293, 17, 310], 16, 24, 1), ([301, 97, 250], 10, 20, 1)])
def test_attention_through_it_equals_attention_through_torchs(seq_lens, B, n, every):
    lay = layout_of(seq_lens, B, n, every, seed=5)
    K, Q = lay.context_keys, lay.num_queries
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, m, 8, generator=g) for m in (Q, K + Q, K + Q))
    ref = create_block_mask(_mask_mod(lay, CPU), None, None, Q, K + Q, device=CPU, BLOCK_SIZE=FLEX_BLOCK)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=_flex_block_mask(lay, CPU)),
                               flex_attention(q, k, v, block_mask=ref), rtol=1e-5, atol=1e-6)
