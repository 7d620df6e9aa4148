"""Batched prefills in the decoding core (decoding/): the prompts of several
refilled rows go through one forward, packed back to back with no padding
(`Core.fresh_packed`, where lengths differ a lot) or left padded, and decoding stays
exactly transformers' greedy generate(), for every family the producer supports (sliding
windows crossed), with rows refilled mid-run several at a time."""

import pytest
import torch

from dflash.decoding.core import Core
from dflash.decoding.greedy import GreedyDecoder
from dflash.tools.families import FAMILIES, WINDOW, tiny_model

pytestmark = pytest.mark.unit

NEW = 12


def _prompts(vocab: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _reference(model, prompt: list[int], max_new: int, stops: set[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new,
                         eos_token_id=sorted(stops) or None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param)


def test_packed_prefill_logits_equal_each_prompt_alone(model):
    prompts = _prompts(model.config.vocab_size, (5, 2 * WINDOW + 3, 1, 9))
    core = Core(model, 4, 64)
    with core.attending(), torch.inference_mode():
        packed = core.fresh_packed(torch.tensor([2, 0, 3, 1]), prompts)
    with torch.inference_mode():  # the model's own attention and masks
        alone = torch.cat([model(input_ids=torch.tensor([p]), use_cache=False, logits_to_keep=1).logits[:, -1]
                           for p in prompts])
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)
    assert torch.equal(packed.argmax(-1), alone.argmax(-1))


def test_rows_refilled_several_at_a_time_decode_exactly_like_generate(model):
    # 9 prompts on 4 rows: refills wait for 2 free rows and take them in one pass, packed
    # where the lengths differ enough, else left padded; lengths cross the sliding window.
    prompts = _prompts(model.config.vocab_size, (3, 2 * WINDOW + 5, 7, 1, 11, WINDOW + 2, 4, 2 * WINDOW, 6))
    lens = [NEW, 3, NEW, 5, 2, NEW, 7, 4, NEW]  # per-job lengths: rows finish at different steps
    want = [_reference(model, p, n, set()) for p, n in zip(prompts, lens)]
    dec = GreedyDecoder(model, rows=4, max_prompt=max(map(len, prompts)), max_new_tokens=NEW, stop_ids=[],
                        sync_every=2, refill_min=2, prefill_tokens=4 * WINDOW + 32)
    from collections import deque

    from dflash.decoding.greedy import Job

    got: dict[int, list[int]] = {}
    left = dec.run(deque(Job(i, p, n) for i, (p, n) in enumerate(zip(prompts, lens))),
                   lambda job, out: got.__setitem__(job.key, out))
    assert left == [] and [got[i] for i in range(len(prompts))] == want
    # fewer prefill passes than prompts: rows were filled together, packed where the
    # lengths differ enough, else left padded
    assert dec.prefills < len(prompts) and 0 < dec.packed_prefills < dec.prefills


def test_prefills_packed_into_fixed_sizes_decode_exactly_like_generate(model):
    # What a GPU runs (PackedPrefill: prompts padded to one of a few sizes, a size's second
    # use replayed from its static buffers), here eager: rows keep decoding while others are
    # refilled with padded packs, so a pad token written where a live row looks would show;
    # the longest prompt exceeds the largest size and goes alone.
    lengths = (3, 2 * WINDOW + 5, 7, 1, 11, WINDOW + 2, 4, 2 * WINDOW, 6, 5, 2, 9, 3 * WINDOW + 1, 8)
    prompts = _prompts(model.config.vocab_size, lengths)
    lens = [NEW, 3, NEW, 5, 2, NEW, 7, 4, NEW, 6, NEW, 3, NEW, 2]
    want = [_reference(model, p, n, set()) for p, n in zip(prompts, lens)]
    sizes = (8, 16, 2 * WINDOW + 8)
    dec = GreedyDecoder(model, rows=4, max_prompt=max(lengths), max_new_tokens=NEW, stop_ids=[], graphs=False,
                        sync_every=2, refill_min=2, prefill_sizes=sizes)
    from collections import deque

    from dflash.decoding.greedy import Job

    got: dict[int, list[int]] = {}
    left = dec.run(deque(Job(i, p, n) for i, (p, n) in enumerate(zip(prompts, lens))),
                   lambda job, out: got.__setitem__(job.key, out))
    assert left == [] and [got[i] for i in range(len(prompts))] == want
    assert dec.prefill.replays > 0  # sizes used again ran from their static buffers
    assert dec.packed_prefills < dec.prefills  # the prompt longer than every size went alone


def test_a_pack_larger_than_its_sizes_is_refused(model):
    dec = GreedyDecoder(model, rows=2, max_prompt=40, max_new_tokens=4, stop_ids=[], graphs=False,
                        prefill_sizes=(16,))
    with pytest.raises(ValueError, match="exceeds 16 tokens"):
        dec.prefill([0, 1], _prompts(model.config.vocab_size, (10, 10)))


@pytest.mark.parametrize("limit", [64, 100, 1000, 4096])
def test_pack_sizes_end_at_the_limit_and_waste_at_most_half_a_small_pack(limit):
    from dflash.decoding.greedy import pack_sizes

    sizes = pack_sizes(limit)
    assert sizes == sorted(set(sizes)) and sizes[-1] == limit and sizes[0] == min(64, limit)
    for a, b in zip(sizes, sizes[1:]):  # a pack of a + 1 tokens pads to b
        assert b <= 2 * a and b - a <= 512, sizes
