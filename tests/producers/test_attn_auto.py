"""`--attn-impl auto` takes an attention implementation the target supports and that packs
correctly (issue 22, item 4): Gemma 2 refuses sdpa in transformers, so auto loads eager on
CPU and it packs; GPT-OSS has no sdpa, its eager masks ignore position IDs (a leak) and
flex refuses its attention sinks on CPU, so auto runs one sequence per forward pass, with
a warning, never a silent leak."""


import pytest
import torch
from structlog.testing import capture_logs

from dflash.producers.build import Components, _check_packing, make_producer
from dflash.producers.producer_config import ProducerConfig
from dflash.producers.packing import PackingError, check_packing
from dflash.producers.producer import LocalWorkSource
from dflash.producers.target import attn_candidates, load_target
from dflash.runtime.hf_compat import causal_lm_class

from tests.harness.families import family_config, family_target

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def test_candidates_follow_the_model_classes_support_flags():
    gemma2, gpt_oss, qwen3 = (causal_lm_class(family_config(f)) for f in ("gemma2", "gpt_oss", "gemma3_text"))
    assert attn_candidates("auto", CPU, gemma2, family_config("gemma2")) == ["eager", "flex_attention"]  # no sdpa for Gemma 2
    assert attn_candidates("auto", CPU, gpt_oss) == ["eager", "flex_attention"]
    assert attn_candidates("auto", CPU, qwen3)[0] == "sdpa"
    assert attn_candidates("auto", torch.device("cuda", 0), gpt_oss)[0] != "sdpa"
    assert attn_candidates("eager", CPU, gemma2) == ["eager"]  # an explicit choice stays
    # A soft-capped config never gets sdpa, even from a class that claims it (transformers 5.17's Gemma 2).
    llama = causal_lm_class(family_config("gemma3_text"))
    capped = family_config("gemma2")
    assert "sdpa" in attn_candidates("auto", CPU, llama, family_config("gemma3_text"))
    assert "sdpa" not in attn_candidates("auto", CPU, llama, capped)
    assert attn_candidates("auto", CPU, None, capped) == ["eager", "flex_attention"]


def test_auto_loads_gemma2_and_it_packs(tmp_path):
    folder = family_target(tmp_path / "gemma2", "gemma2")
    t = load_target(str(folder), "0,2", device=CPU, attn_impl="auto")
    assert t.info.attn_impl == "eager"
    err, leak = _check_packing(t, auto_attn=True)
    assert err < 1e-5 < leak and not t.per_sequence


def test_gpt_oss_runs_one_sequence_per_pass_with_a_warning(tmp_path):
    folder = family_target(tmp_path / "gpt_oss", "gpt_oss")
    t = load_target(str(folder), "0,2", device=CPU, attn_impl="auto")
    with capture_logs() as logs:
        _check_packing(t, auto_attn=True)
    assert t.per_sequence and t.info.attn_impl == "eager"
    (warn,) = [e for e in logs if e["event"] == "produce.per_sequence"]
    assert set(warn["tried"]) == {"eager", "flex_attention"} and warn["log_level"] == "warning"
    with pytest.raises(PackingError):  # it does leak: per-sequence is not a formality
        check_packing(t.capture, t.info.vocab_size)
    cfg = ProducerConfig(target=str(folder), data="unused.jsonl", max_batch_size=64)
    producer = make_producer(cfg, Components(t, None, None, None), LocalWorkSource(4), sink=None)
    assert producer.max_batch_size == 1


def test_an_explicit_attention_that_leaks_is_refused_naming_what_works(tmp_path):
    folder = family_target(tmp_path / "gpt_oss", "gpt_oss")
    t = load_target(str(folder), "0,2", device=CPU, attn_impl="eager")
    with pytest.raises(PackingError, match="with --attn-impl eager; no attention implementation of this model "
                                           "packs correctly here: --attn-impl auto runs one sequence per forward"):
        _check_packing(t, auto_attn=False)
    assert t.info.attn_impl == "eager" and not t.per_sequence
