"""The decoding core (decoding/) gives exactly transformers' greedy generate()
tokens, for every family the producer supports, sliding windows crossed, with continuous
batching (more prompts than rows, rows refilled mid-run) and stop tokens."""

import pytest
import torch

from dflash.decoding.attention import layer_windows
from dflash.decoding.core import Core
from dflash.decoding.greedy import greedy_generate, GreedyDecoder
from dflash.decoding.ties import divergence, is_tie_flip
from dflash.tools.families import FAMILIES, WINDOW, tiny_model

pytestmark = pytest.mark.unit

NEW = 20


def _prompts(vocab: int, lengths=(3, 13, 2 * WINDOW + 5, 7, 1)) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _reference(model, prompt: list[int], max_new: int, stops: set[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new,
                         eos_token_id=sorted(stops), pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param)


def test_windows_are_read_from_the_config(model):
    w = layer_windows(model)
    kind = model.config.model_type
    assert len(w) == model.config.num_hidden_layers
    if kind in ("llama", "qwen3"):
        assert w == [None] * 4
    elif kind in ("mistral", "phi3"):
        assert w == [WINDOW] * 4
    else:  # mixed: each layer as its layer_types say
        assert set(w) == {None, WINDOW}
        assert w == [WINDOW if t == "sliding_attention" else None for t in model.config.layer_types]


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
def test_greedy_equals_generate_across_the_window_with_continuous_batching(model, kernel):
    prompts = _prompts(model.config.vocab_size)
    stops = {2}
    want = [_reference(model, p, NEW, stops) for p in prompts]
    assert any(len(p) + NEW > 2 * WINDOW for p in prompts)
    # 2 rows for 5 prompts: rows are refilled as others finish; check every 3 steps.
    dec = GreedyDecoder(model, rows=2, max_prompt=max(map(len, prompts)), max_new_tokens=NEW, stop_ids=stops,
                        sync_every=3, refill_min=1, kernel=kernel)
    assert dec.core.kernel == (kernel if dec.core.attn != "eager" else "sdpa")
    assert dec.generate(prompts) == want
    if kernel == "flex":
        return
    assert greedy_generate(model, prompts, max_new_tokens=NEW, stop_ids=stops, batch_size=8) == want


def test_stop_tokens_end_rows_at_different_steps(model):
    prompts = _prompts(model.config.vocab_size)
    base = [_reference(model, p, NEW, set()) for p in prompts]
    # Stop at a token some outputs emit early and others late or never.
    stops = {base[0][4], base[2][11]}
    want = [_reference(model, p, NEW, stops) for p in prompts]
    assert len({len(w) for w in want}) > 1
    got = greedy_generate(model, prompts, max_new_tokens=NEW, stop_ids=stops, batch_size=3, sync_every=5)
    assert got == want
    for w in want:
        cut = next((i for i, t in enumerate(w) if t in stops), None)
        assert cut is None or cut == len(w) - 1  # the stop token is kept, nothing after it


def test_step_with_a_cropped_length_equals_a_fresh_forward(model):
    """What speculative decoding does: verify a block, keep a prefix, verify the next block
    from there; logits equal one plain forward over the kept sequence (past the window)."""
    vocab = model.config.vocab_size
    seq = _prompts(vocab, (3 * WINDOW + 4,))[0]
    core = Core(model, 1, 64)
    zero = torch.zeros(1, dtype=torch.long)
    got = []
    with core.attending(), torch.inference_mode():
        core.fresh(zero, torch.tensor([seq[:5]]), zero)
        at = 5
        for block, keep in ((6, 2), (6, 6), (6, 0), (6, 3), (5, 5)):
            logits, _ = core.step(torch.tensor([seq[at:at + block]]), torch.tensor([at]), zero)
            got.append((at, block, logits[0].clone()))
            at += keep + 1 if keep < block else block  # crop: only a length moves
    for at, block, logits in got:  # the model's own attention, outside the core's
        ref = model(input_ids=torch.tensor([seq[:at + block]])).logits[0, at:]
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_divergence_measures_the_margin_and_the_tie_rule():
    model = tiny_model("llama", seed=3)
    prompt = _prompts(model.config.vocab_size, (6,))[0]
    base = _reference(model, prompt, 8, set())
    # A near-tie made exact: the LM head row of a twin token copies the row of the token
    # greedy emits at step 3, so both have the same logit there.
    head = model.get_output_embeddings().weight
    twin = next(t for t in range(3, model.config.vocab_size) if t not in base)
    head[twin] = head[base[3]]
    swapped = base[:3] + [twin] + base[4:]
    div = divergence(model, prompt, base, swapped)
    assert div["index"] == 3 and div["tokens"] == [base[3], twin]
    assert div["flip_margin"] == pytest.approx(0.0, abs=1e-6)
    assert is_tie_flip(div, 0.5) and is_tie_flip(div, 0.0)
    # A token far from the top is no tie, whatever the tolerance a low precision allows.
    logits = model(input_ids=torch.tensor([prompt + base[:3]])).logits[0, -1]
    worst = int(logits.argmin())
    div = divergence(model, prompt, base, base[:3] + [worst])
    assert div["flip_margin"] > 0.5 and not is_tie_flip(div, 0.5)
    assert divergence(model, prompt, base, list(base)) is None
    stopped = divergence(model, prompt, base, base[:5])
    assert stopped["index"] == 5 and not is_tie_flip(stopped, 10.0)


def test_a_job_may_ask_for_fewer_new_tokens():
    from collections import deque

    from dflash.decoding.greedy import Job

    model = tiny_model("qwen3")
    prompts = _prompts(model.config.vocab_size)
    full = greedy_generate(model, prompts, max_new_tokens=NEW, stop_ids=set(), batch_size=2)
    dec = GreedyDecoder(model, rows=2, max_prompt=40, max_new_tokens=NEW, stop_ids=set(), refill_min=1)
    got = {}
    left = dec.run(deque(Job(i, p, max_new=1 + 3 * i) for i, p in enumerate(prompts)),
                   lambda j, out: got.__setitem__(j.key, out))
    assert left == [] and [got[i] for i in range(len(prompts))] == [f[: 1 + 3 * i] for i, f in enumerate(full)]
    # A prompt longer than the decoder takes comes back undecoded, for a larger decoder.
    left = dec.run(deque([Job("long", list(range(3, 50)))]), lambda j, out: None)
    assert [j.key for j in left] == ["long"]


def test_the_decoding_core_and_the_shape_builder_load_without_zmq_or_structlog():
    """bench/decode_speed.py runs on a bare GPU machine (torch and transformers only): the
    modules it imports must not pull in the wire or the logs."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['zmq'] = sys.modules['structlog'] = None\n"
            "import dflash.decoding.greedy, dflash.decoding.ties, dflash.tools.families\n"
            "dflash.tools.families.build(dflash.tools.families.tiny_config('llama', layers=2))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def test_flex_block_lists_cover_every_visible_slot_and_no_block_outside_the_row():
    """Core._block_masks lists, for each row, the K/V blocks its queries may see: every slot a
    query sees lies in a listed block, and no listed block lies wholly outside the row's
    visible range (padding before `off`, empty slots after the last query, slots past a window)."""
    model = tiny_model("qwen2_sliding")
    g = torch.Generator().manual_seed(3)
    core = Core(model, 32, 200, graphs=False, kernel="flex", kv_block=16)
    for q in (1, 5):
        off = torch.randint(0, 60, (32,), generator=g)
        start = off + torch.randint(0, 200 - 60 - q, (32,), generator=g)
        qslot = start[:, None] + torch.arange(q)[None]
        masks = core._block_masks(qslot, off)
        masks = masks if isinstance(masks, dict) else {"full_attention": masks}
        assert set(masks) == {"full_attention", "sliding_attention"}
        s = torch.arange(200)
        for kind, bm in masks.items():
            w = None if kind == "full_attention" else WINDOW
            count, index = bm.kv_num_blocks[:, 0, 0], bm.kv_indices[:, 0, 0]
            for b in range(32):
                listed = set(index[b, : count[b]].tolist())
                vis = (s[None] >= off[b]) & (s[None] <= qslot[b][:, None])
                if w is not None:
                    vis &= qslot[b][:, None] - s[None] < w
                need = set((s[vis.any(0)] // 16).tolist())
                assert need <= listed, (kind, b, sorted(need - listed))
                assert listed <= need, (kind, b, sorted(listed - need))


@pytest.mark.parametrize("group", [2, 3])
def test_the_compiled_flex_kernel_decodes_exactly(monkeypatch, group):
    """The flex path as it runs on a GPU (compiled: the kernel reads only the listed blocks),
    here on the CPU's compiled kernel, full and sliding layers, small blocks so that rows
    span several, query heads per K/V head a power of two (grouped-query flex) or not
    (heads folded into the query length): equal to generate()."""
    import dflash.decoding.attention as decode
    from dflash.tools.families import build, tiny_config

    monkeypatch.setattr(decode, "FLEX_COMPILE", True)
    if group == 2:
        model = tiny_model("qwen2_sliding")
    else:
        cfg = tiny_config("mistral")
        cfg.num_attention_heads, cfg.num_key_value_heads = 6, 2
        model = build(cfg)
    assert decode.fold_heads(model.config.num_attention_heads, model.config.num_key_value_heads) == (group == 3)
    prompts = _prompts(model.config.vocab_size)
    want = [_reference(model, p, NEW, set()) for p in prompts]
    dec = GreedyDecoder(model, rows=3, max_prompt=max(map(len, prompts)), max_new_tokens=NEW, stop_ids=set(),
                        sync_every=4, refill_min=1, kernel="flex", kv_block=16)
    assert dec.core.kernel == "flex"
    assert dec.generate(prompts) == want


def test_a_flex_kernel_that_fails_falls_back_to_sdpa_and_says_why(monkeypatch):
    import dflash.decoding.attention as decode

    def broken(*a, **k):
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(decode, "flex_attention", broken)
    model = tiny_model("llama")
    prompts = _prompts(model.config.vocab_size)
    with pytest.warns(UserWarning, match="flex decode attention failed"):
        dec = GreedyDecoder(model, rows=2, max_prompt=max(map(len, prompts)), max_new_tokens=NEW, stop_ids=set(),
                            kernel="flex")
    assert dec.core.kernel == "sdpa" and "no kernel for you" in dec.core.kernel_error
    assert dec.generate(prompts) == [_reference(model, p, NEW, set()) for p in prompts]
