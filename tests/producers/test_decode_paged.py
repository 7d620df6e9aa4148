"""The paged KV cache (decoding/paged.py): a row holds the pages its own prompt and answer
fill, so with mixed prompt lengths (many short, one long) the rows decoding at once are
set by the pages, not by the longest prompt, and every answer is still exactly
transformers' greedy generate()."""

from collections import deque

import pytest
import torch

from dflash.decoding.greedy import GreedyDecoder, Job, pack_sizes
from dflash.tools.families import WINDOW, tiny_model

pytestmark = pytest.mark.unit

NEW = 12
PAGE = 8


def _prompts(vocab: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _reference(model, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _run(dec: GreedyDecoder, prompts: list[list[int]], long_key: int):
    """Decode every prompt round by round; returns the answers and the most rows that
    decoded in one round while the long job was running."""
    jobs = deque(Job(i, p) for i, p in enumerate(prompts))
    got: dict[int, list[int]] = {}
    left: list[Job] = []
    most = 0
    with dec.core.attending(), torch.inference_mode():
        for _ in dec.rounds(jobs, lambda j, out: got.__setitem__(j.key, out), left):
            assert dec.book.used <= dec.book.total
            if long_key not in got and all(j.key != long_key for j in jobs):
                most = max(most, dec.live)
    assert left == []
    return [got[i] for i in range(len(prompts))], most


@pytest.mark.parametrize("family,kernel", [("llama", "sdpa"), ("qwen2_sliding", "sdpa"), ("llama", "flex"),
                                          ("qwen2_sliding", "flex")])
def test_rows_are_set_by_the_pages_not_by_the_longest_prompt(family, kernel):
    model = tiny_model(family)
    lengths = [6, 60, 3, 5, 4, 7, 2, 6, 5, 3, 4, 6, 5, 7, 3]  # one long prompt among short ones
    prompts = _prompts(model.config.vocab_size, lengths)
    want = [_reference(model, p, NEW) for p in prompts]
    pages = 24  # 192 slots
    # The fixed layout gives every row the longest prompt + the answer cap (+1):
    old_rows = pages * PAGE // (max(lengths) + NEW + 1)
    assert old_rows == 2
    dec = GreedyDecoder(model, rows=12, max_prompt=max(lengths), max_new_tokens=NEW, stop_ids=[], sync_every=2,
                        refill_min=1, kernel=kernel, kv_block=PAGE, pages=pages)
    assert dec.core.kernel == kernel and dec.core.paged
    got, most = _run(dec, prompts, long_key=1)
    assert got == want
    # the long row (9 pages) decodes beside many short ones (2-3 pages each)
    assert most >= 5 > old_rows, most
    print(f"{family} {kernel}: {most} rows beside the long one (fixed layout: {old_rows})")
    assert sorted(dec.book.free) == list(range(pages))  # every page came back, once


def test_rows_that_run_out_of_pages_give_them_back_and_start_again():
    model = tiny_model("qwen2_sliding")
    lengths = [30, 9, 14, 2 * WINDOW + 5, 11, 12, 10, 13]
    prompts = _prompts(model.config.vocab_size, lengths)
    want = [_reference(model, p, NEW) for p in prompts]
    # 6 pages (48 slots): each job starts with 2-4 pages and grows to 3-6, so rows that
    # started together cannot all finish: the newest give their pages back.
    dec = GreedyDecoder(model, rows=6, max_prompt=max(lengths), max_new_tokens=NEW, stop_ids=[], sync_every=4,
                        refill_min=1, kv_block=PAGE, pages=6)
    got, _ = _run(dec, prompts, long_key=0)
    assert got == want
    assert dec.preempted > 0
    assert dec.book.used == 0


def test_left_padded_and_graphed_pack_prefills_store_no_padding():
    """Refills of similar lengths are left padded in one forward; the paged cache stores
    each prompt from slot 0. The fixed pack sizes (PackedPrefill, eager here) write their
    pad tokens where no row reads."""
    model = tiny_model("qwen3")
    lengths = [9, 10, 11, 9, 10, 12, 11, 10, 3, 40]
    prompts = _prompts(model.config.vocab_size, lengths)
    want = [_reference(model, p, NEW) for p in prompts]
    dec = GreedyDecoder(model, rows=4, max_prompt=max(lengths), max_new_tokens=NEW, stop_ids=[], sync_every=3,
                        refill_min=4, kv_block=PAGE, pages=16)
    assert dec.generate(prompts) == want
    assert dec.prefills > dec.packed_prefills  # some refills were left padded
    packs = GreedyDecoder(model, rows=4, max_prompt=max(lengths), max_new_tokens=NEW, stop_ids=[], sync_every=3,
                          refill_min=2, kv_block=PAGE, pages=16, prefill_sizes=pack_sizes(64), graphs=False)
    assert packs.generate(prompts) == want
    assert packs.packed_prefills > 0 and packs.prefill.limit == 64


def test_pages_that_cannot_hold_one_job_are_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="do not hold one job"):
        GreedyDecoder(model, rows=4, max_prompt=60, max_new_tokens=NEW, stop_ids=[], kv_block=PAGE, pages=8)


def test_fewer_pages_decode_fewer_rows_at_once():
    """The rows decoding beside the long job follow the pages, with rows to spare."""
    model = tiny_model("llama")
    lengths = [6, 60, 3, 5, 4, 7, 2, 6, 5, 3, 4, 6, 5, 7, 3]
    prompts = _prompts(model.config.vocab_size, lengths)
    want = [_reference(model, p, NEW) for p in prompts]
    most = {}
    for pages in (12, 24):
        dec = GreedyDecoder(model, rows=len(prompts), max_prompt=max(lengths), max_new_tokens=NEW, stop_ids=[],
                            sync_every=2, refill_min=1, kv_block=PAGE, pages=pages)
        got, most[pages] = _run(dec, prompts, long_key=1)
        assert got == want
    assert 1 < most[12] < most[24] < len(prompts), most


def test_the_compiled_flex_kernel_reads_the_pages_exactly(monkeypatch):
    """The flex path as it runs on a GPU (compiled: the kernel reads only the listed pages),
    here on the CPU's compiled kernel, full and sliding layers, rows over several pages."""
    import dflash.decoding.attention as decode

    monkeypatch.setattr(decode, "FLEX_COMPILE", True)
    model = tiny_model("qwen2_sliding")
    lengths = [3, 13, 2 * WINDOW + 5, 7, 1, 30]
    prompts = _prompts(model.config.vocab_size, lengths)
    want = [_reference(model, p, NEW) for p in prompts]
    dec = GreedyDecoder(model, rows=3, max_prompt=max(lengths), max_new_tokens=NEW, stop_ids=[], sync_every=4,
                        refill_min=1, kernel="flex", kv_block=16, pages=8)
    assert dec.core.kernel == "flex"
    assert dec.generate(prompts) == want
