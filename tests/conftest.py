"""The one conftest of the suite: fixtures shared by the test folders (their helpers are in
tests/harness). Fixtures that belonged to one folder keep to it (`_in`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import structlog
import torch

from tests.harness.broker import broker_procs, start_broker  # noqa: F401  (start_broker: the fixture)
from tests.harness.spawn import STATS, spawn
from tests.harness.tiny import tiny_dir, tiny_target

TESTS = Path(__file__).resolve().parent

# The machine is shared (and CI has two cores): torch uses one thread.
torch.set_num_threads(1)

FAMILIES = [("qwen3", False), ("llama", True)]


@pytest.fixture(autouse=True)
def _structlog_defaults():
    """Every test starts from structlog's defaults: a level filter (`setup_logging(level=
    "warning")`) or processors that an earlier in-process run configured would hide this
    test's lines from `capture_logs`, and only in the full suite."""
    structlog.reset_defaults()
    yield


def _in(request, folder: str) -> bool:
    """Whether the requesting test lives in tests/<folder>."""
    return Path(request.path).resolve().relative_to(TESTS).parts[0] == folder


# ---------------------------------------------------------------- consumers


@pytest.fixture(autouse=True)
def _few_threads(request):
    # The CI machine has two cores shared with other test runs.
    if _in(request, "consumers"):
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory):
    """A tiny untied Qwen3 target saved with save_pretrained (one safetensors file)."""
    return tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def heads(target_dir):
    from dflash.runtime.target_heads import load_target_heads

    return load_target_heads(target_dir, dtype=torch.float32)


# ---------------------------------------------------------------- producers
# Tiny real targets (Qwen3 untied, Llama tied) built from configs, loaded through the same
# path as a real checkpoint; built once and cached (~/.cache/dflash/tiny, or $DFLASH_TINY_CACHE).


@pytest.fixture(scope="session")
def _isolated_cache(tmp_path_factory):
    # Line indexes go to a per-session folder, never the user's cache.
    old = os.environ.get("DFLASH_CACHE")
    os.environ["DFLASH_CACHE"] = str(tmp_path_factory.mktemp("dflash-cache"))
    yield
    if old is None:
        os.environ.pop("DFLASH_CACHE", None)
    else:
        os.environ["DFLASH_CACHE"] = old


@pytest.fixture(autouse=True)
def _producer_cache(request):
    # From the first producer test to the end of the session, as the folder's own session fixture did
    if _in(request, "producers"):
        request.getfixturevalue("_isolated_cache")


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


# ---------------------------------------------------------------- brokers and fakes


@pytest.fixture
def brokers(tmp_path):
    """`brokers(*args, n_out=8, env=None)` starts a broker on free loopback ports under tmp_path/runs."""
    with broker_procs(tmp_path / "runs") as start:
        yield start


@pytest.fixture
def fakes():
    """`fakes(role, broker, *args)` -> Popen of a stats fake (tests/harness/stats_fakes.py);
    every process is killed at the end."""
    procs = []

    def start(role, broker, *args):
        # stdout to /dev/null: a fake logs a line per step, and an unread pipe would block it
        p = spawn(STATS, role, broker, *args, stdout=subprocess.DEVNULL)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(5)
