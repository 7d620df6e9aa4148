"""Varlen packing: packed hidden states equal each sequence run alone; the packer keeps
every sample once within budget; a model that leaks across sequences is refused."""

from __future__ import annotations

import pytest
import torch

from dflash.producers.chat import Encoded
from dflash.producers.packing import PackingError, check_packing, pack
from dflash.protocol.batch import position_ids
from dflash.producers.target import load_target

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def _seqs(vocab: int, lens: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def test_position_ids_restart_per_sequence():
    assert position_ids([3, 1, 2]).tolist() == [0, 1, 2, 0, 0, 1]


@pytest.mark.parametrize("dtype,attn,atol", [
    ("float32", "sdpa", 1e-5), ("float32", "eager", 1e-5), ("bfloat16", "sdpa", 1e-2)])
def test_packed_equals_each_sequence_alone(tiny, dtype, attn, atol):
    t = load_target(str(tiny), "0,2,3", device=CPU, dtype=dtype, attn_impl=attn)
    lens = [9, 1, 17, 4, 12]
    seqs = _seqs(t.info.vocab_size, lens)
    packed = t.capture(torch.cat(seqs), position_ids(lens))
    alone = torch.cat([t.capture(s, torch.arange(len(s))) for s in seqs])
    assert packed.dtype == getattr(torch, dtype)
    torch.testing.assert_close(packed.float(), alone.float(), rtol=0, atol=atol)
    # And the comparison has teeth: the same tokens run as one sequence (attention across
    # the boundaries) differ by far more than packing does.
    as_one = t.capture(torch.cat(seqs), torch.arange(sum(lens)))
    leak = (as_one.float() - alone.float()).abs().max()
    assert leak > 5 * atol and leak > 10 * (packed.float() - alone.float()).abs().max(), leak


def test_startup_check_refuses_a_model_that_leaks_across_sequences(target):
    err, leak = check_packing(target.capture, target.info.vocab_size)
    assert err < 1e-5 and leak > 0.1

    def ignores_positions(ids, _pos):  # what a family without packing support would do
        return target.capture(ids, torch.arange(len(ids)))

    with pytest.raises(PackingError, match="do not honour|does not honour"):
        check_packing(ignores_positions, target.info.vocab_size)


def _enc(sample: int, n: int) -> Encoded:
    return Encoded(sample, list(range(n)), [1] * n)


def test_pack_respects_budget_and_batch_size_and_keeps_every_sample_once():
    lens = [50, 10, 300, 70, 5, 90, 120, 33, 64, 64, 1, 200]
    batches = pack([_enc(i, n) for i, n in enumerate(lens)], token_budget=256, max_batch_size=3,
                   lease=7, epoch=2)
    seen = [s for b in batches for s in b.samples]
    assert sorted(seen) == list(range(len(lens)))
    for b in batches:
        assert b.lease == 7 and b.epoch == 2
        assert len(b.samples) <= 3
        assert b.seq_lens == [lens[s] for s in b.samples]
        assert b.tokens == sum(b.seq_lens) == len(b.loss_mask)
        assert b.input_ids.dtype == torch.int32 and b.loss_mask.dtype == torch.uint8
        assert b.tokens <= 256 or len(b.samples) == 1  # only an oversize sequence goes alone
    assert any(b.samples == [2] for b in batches)  # 300 > 256: its own batch
    # First-fit decreasing packs 1,258 tokens into few batches.
    assert len(batches) <= 7


def test_a_packed_batch_splits_in_two_by_whole_sequences():
    (b,) = pack([_enc(0, 3), _enc(1, 2), _enc(2, 4)], 100, 10, lease=4, epoch=1)
    left, right = b.split(2)  # the capture's OOM path: about half the tokens each
    assert left.samples + right.samples == b.samples and (left.lease, right.epoch) == (4, 1)
    assert torch.equal(torch.cat([left.input_ids, right.input_ids]), b.input_ids)
    assert left.seq_lens + right.seq_lens == b.seq_lens == [4, 3, 2]
    (one,) = pack([_enc(0, 3)], 100, 10)
    assert one.split(2) == [one]  # one sequence: nothing to split (the OOM path skips it)
