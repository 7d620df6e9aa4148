"""Shared fixtures: tiny real targets (Qwen3 untied, Llama tied) built from configs, loaded
through the same path as a real checkpoint. Built once and cached (~/.cache/dflash/tiny,
or $DFLASH_TINY_CACHE); the machine is shared, so torch uses one thread."""

from __future__ import annotations

import os

import pytest
import torch
from tests.harness.tiny import tiny_dir

torch.set_num_threads(1)

FAMILIES = [("qwen3", False), ("llama", True)]


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    # Line indexes go to a per-session folder, never the user's cache.
    old = os.environ.get("DFLASH_CACHE")
    os.environ["DFLASH_CACHE"] = str(tmp_path_factory.mktemp("dflash-cache"))
    yield
    if old is None:
        os.environ.pop("DFLASH_CACHE", None)
    else:
        os.environ["DFLASH_CACHE"] = old


@pytest.fixture(scope="session", params=FAMILIES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in FAMILIES])
def family(request):
    return request.param


@pytest.fixture(scope="session")
def tiny(family):
    return tiny_dir(*family)


@pytest.fixture(scope="session")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


@pytest.fixture(scope="session")
def target(tiny):
    from dflash.producers.target import load_target

    return load_target(str(tiny), None, device=torch.device("cpu"))


@pytest.fixture(scope="session")
def reference(tiny):
    """The same checkpoint as a plain HF model: what the producer must agree with."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny).eval()
