"""How much of the drafter's flex attention work is useful, counted on the CPU (no GPU needed).

    python bench/flex_tiles.py [--seqs 16 --seq-len 290 --batches 6]

The batches are drafter_step.py's `--vary` shapes (16 sequences, a new length each batch,
6 prompt tokens, every trainable position an anchor, block 16). For each, the block mask
the consumer builds (consumers/drafter/blocks.py `_flex_block_mask`) lists the 128 x 128
tiles flex attention computes; a tile is partial (the element rule is evaluated in it) or
full. `useful` is the share of the computed scores that a query may see (its context
before its anchor and its own block: flops.py's attended keys). The layout pads the
context's keys to a multiple of 128, so that a query tile's block keys start a key tile;
`unaligned` counts the tiles the same mask would reach without that padding, and
`aligned_saves` what the padding saves. One JSON line.
"""

from __future__ import annotations

import json

import click
import torch

from dflash.consumers.drafter.blocks import FLEX_BLOCK, _flex_block_mask, _flex_bounds, anchor_seed, build_layout, \
    sample_anchors, tile_sets


def _anchors(n_seqs: int, L: int, B: int, prompt: int = 6) -> list[torch.Tensor]:
    mask = torch.ones(L, dtype=torch.bool)
    mask[:prompt] = False
    return [sample_anchors(mask, B, 512, anchor_seed(0, 0, s)) for s in range(n_seqs)]


def _tiles_with_context(lay, T_keys: int) -> int:
    """Tiles reached when the block keys start at key row `T_keys` (>= the context's T), as _flex_block_mask does."""
    T, Q = lay.ctx_pos.shape[0], lay.num_queries
    partial, full = tile_sets(_flex_bounds(lay.seq_lens, lay.anchors, lay.spans, T_keys, Q, lay.block_size), T,
                              T_keys + Q)
    return int(partial.sum() + full.sum())


@click.command()
@click.option("--seqs", default=16)
@click.option("--seq-len", default=290)
@click.option("--batches", default=6)
@click.option("--block-size", default=16)
def main(seqs, seq_len, batches, block_size) -> None:
    B, N, cpu = block_size, FLEX_BLOCK, torch.device("cpu")
    rows, totals = [], {"partial": 0, "full": 0, "unaligned": 0, "useful": 0}
    for i in range(batches):
        L = seq_len - (41 * i) % max(1, seq_len // 2)  # drafter_step.py --vary
        anchors = _anchors(seqs, L, B)
        lay = build_layout([L] * seqs, anchors, B, cpu, "flex")
        bm = _flex_block_mask(lay, cpu)
        partial, full = int(bm.kv_num_blocks.sum()), int(bm.full_kv_num_blocks.sum())
        T = L * seqs
        unaligned = _tiles_with_context(lay, T)
        assert _tiles_with_context(lay, lay.context_keys) == partial + full  # the count below is the mask's own
        useful = sum(int(a.sum()) * B + a.numel() * B * B for a in anchors)
        rows.append({"seq_len": L, "context": T, "queries": lay.num_queries, "query_tiles": -(-lay.num_queries // N),
                     "partial": partial, "full": full, "unaligned": unaligned})
        for k, v in (("partial", partial), ("full", full), ("unaligned", unaligned), ("useful", useful)):
            totals[k] += v
    computed = (totals["partial"] + totals["full"]) * N * N
    print(json.dumps({"tile": N, "block_size": B, "batches": rows, "useful": round(totals["useful"] / computed, 3),
                      "partial_share": round(totals["partial"] / (totals["partial"] + totals["full"]), 3),
                      "useful_unaligned": round(totals["useful"] / (totals["unaligned"] * N * N), 3),
                      "aligned_saves": round(1 - (totals["partial"] + totals["full"]) / totals["unaligned"], 3)}))


if __name__ == "__main__":
    main()
