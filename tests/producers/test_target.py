"""Layer capture: equal to HF `hidden_states[i+1]`, and nothing computed after the last
wanted layer (no LM head, no logits)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from tests.harness.tiny import tiny_dir
from torch.profiler import ProfilerActivity, profile

from dflash.producers.target import TargetError, load_target, parse_layer_ids
from dflash.runtime.targets import default_layer_ids

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def reference_hidden(model, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids.view(1, -1), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)


def test_default_layers_follow_dflash_spacing():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(64) == [1, 16, 31, 46, 61]
    assert default_layer_ids(6) == [1, 2, 3]  # small models: the distinct rounded layers
    assert default_layer_ids(4) == [1]
    assert default_layer_ids(3) == [0, 1]
    for L in range(2, 80):
        ids = default_layer_ids(L)
        assert ids == sorted(set(ids)) and max(ids) <= L - 2, L


def test_layer_spec_is_validated():
    assert parse_layer_ids("3, 0,2", 6) == [3, 0, 2]
    for bad, why in [("5", "out of range"), ("1,1", "repeats"), ("a,b", "integers"), ("-1", "out of range")]:
        with pytest.raises(TargetError, match=why):
            parse_layer_ids(bad, 6)


@pytest.mark.parametrize("spec", [None, "0,2,4", "3,0"])
def test_capture_equals_output_hidden_states(tiny, reference, spec):
    t = load_target(str(tiny), spec, device=CPU)
    ids = torch.randint(0, t.info.vocab_size, (37,), generator=torch.Generator().manual_seed(1))
    got = t.capture(ids, torch.arange(37))
    want = reference_hidden(reference, ids, t.layer_ids)
    assert got.shape == (37, len(t.layer_ids) * t.hidden_size)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_nothing_after_the_last_wanted_layer_runs(tiny):
    # A full model still has the LM head and every layer: hooks show what actually runs.
    t = load_target(str(tiny), "1,2", device=CPU, full=True)
    calls: list[str] = []
    hooks = [t.model.lm_head.register_forward_hook(lambda *a: calls.append("lm_head")),
             t.decoder.norm.register_forward_hook(lambda *a: calls.append("norm"))]
    hooks += [layer.register_forward_hook(lambda *a, i=i: calls.append(f"layer{i}"))
              for i, layer in enumerate(t.layers)]
    t.capture(torch.arange(10), torch.arange(10))
    for h in hooks:
        h.remove()
    assert calls == ["layer0", "layer1", "layer2"]


def test_capture_only_model_drops_tail_layers_and_lm_head(tiny):
    from transformers import AutoModelForCausalLM

    t = load_target(str(tiny), "1,2", device=CPU)
    assert len(t.layers) == 3 and t.model is None
    full = AutoModelForCausalLM.from_pretrained(tiny)
    kept = sum(p.numel() for p in t.decoder.parameters())
    dropped_layers = sum(p.numel() for layer in full.model.layers[3:] for p in layer.parameters())
    assert kept == sum(p.numel() for p in full.model.parameters()) - dropped_layers
    # The CausalLM wrapper (and an untied LM head with it) is garbage once loaded.
    gone = weakref.ref(full)
    del full
    gc.collect()
    assert gone() is None


def _peak_cpu_bytes(fn) -> int:
    """Peak of live CPU tensor bytes allocated while `fn` runs (profiler memory events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cur = peak = 0
    for ev in sorted((e for e in prof.events() if e.cpu_memory_usage), key=lambda e: e.time_range.start):
        cur += ev.cpu_memory_usage
        peak = max(peak, cur)
    return peak


def test_capture_saves_the_logits_and_other_layers_memory():
    """The field's OOM came from output_hidden_states=True + logits. With a vocabulary of
    8192 the logits of 1024 tokens are 32 MiB: capture's peak must be lower by at least
    that, which fails the moment capture computes logits."""
    from transformers import AutoModelForCausalLM

    path = tiny_dir("qwen3", False, model_vocab=8192)
    t = load_target(str(path), None, device=CPU)
    naive_model = AutoModelForCausalLM.from_pretrained(path).eval()
    T = 1024
    ids = torch.randint(0, 600, (T,), generator=torch.Generator().manual_seed(0))
    captured = t.capture(ids, torch.arange(T))
    naive = reference_hidden(naive_model, ids, t.layer_ids)
    torch.testing.assert_close(captured, naive, rtol=0, atol=1e-6)

    logits_bytes = T * 8192 * 4
    peak_capture = _peak_cpu_bytes(lambda: t.capture(ids, torch.arange(T)))
    peak_naive = _peak_cpu_bytes(lambda: reference_hidden(naive_model, ids, t.layer_ids))
    assert peak_capture + logits_bytes <= peak_naive, (peak_capture, peak_naive)
    # What is kept: n layers, not L+1 hidden states plus logits.
    assert captured.nbytes == T * len(t.layer_ids) * t.hidden_size * 4


def test_attention_can_be_switched_in_place(tiny):
    # The start-up fallback (auto-chosen flex/flash that cannot run here -> sdpa) relies on it.
    t = load_target(str(tiny), None, device=CPU, attn_impl="eager")
    ids = torch.arange(25)
    eager = t.capture(ids, torch.arange(25))
    t.set_attn("sdpa")
    assert t.info.attn_impl == "sdpa" and t.layers[0].self_attn.config._attn_implementation == "sdpa"
    torch.testing.assert_close(t.capture(ids, torch.arange(25)), eager, rtol=0, atol=1e-5)


def test_auto_attention_that_cannot_run_falls_back_to_sdpa(tiny):
    from structlog.testing import capture_logs

    from dflash.producers.build import _check_packing

    t = load_target(str(tiny), None, device=CPU, attn_impl="eager")
    t.info.attn_impl = "flex_attention"  # as if auto had picked it
    real = t.capture

    def compile_fails_until_sdpa(ids, pos):
        if t.info.attn_impl != "sdpa":
            raise RuntimeError("torch.compile: no working C compiler")
        return real(ids, pos)

    t.capture = compile_fails_until_sdpa
    with capture_logs() as logs:
        err, _ = _check_packing(t, auto_attn=True)
    assert err < 1e-5 and t.info.attn_impl == "sdpa"
    assert [e["attn_impl"] for e in logs if e["event"] == "produce.attn_fallback"] == ["flex_attention"]
    t.info.attn_impl = "flex_attention"
    with pytest.raises(RuntimeError, match="no working C compiler"):
        _check_packing(t, auto_attn=False)  # an explicit choice is never overridden
