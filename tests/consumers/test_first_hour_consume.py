"""The consumer as a new user starts it (issue 20): a hub ID in the local Hugging Face cache
as --target, --device like the producer's, a default instance name of its own per process."""

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.harness.tiny import MASK_ID
from dflash.consumers.process.consume_command import main

from tests.harness.hub_cache import put_in_hub_cache

pytestmark = pytest.mark.integration


def _args(target, runs, *extra):
    return ["--target", str(target), "--runs-dir", str(runs), "--draft-layers", "1", "--target-layers", "1,2",
            "--block-size", "4", "--anchors", "6", "--mask-token-id", str(MASK_ID), "--synthetic-seq-len", "32",
            "--synthetic-seqs", "2", "--synthetic-batches", "1", "--save-every", "0", *extra]


@pytest.fixture
def hub(tmp_path, monkeypatch, target_dir):
    cache = tmp_path / "hf-cache"
    snap = put_in_hub_cache(cache, "Org/Tiny-Target", target_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))  # read at import; the env var is for subprocesses
    return snap


def _start_event(runs: Path) -> dict:
    (log,) = (runs / "latest" / "logs").glob("consumer-*.jsonl")
    return next(e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "consume.start")


def test_a_cached_hub_id_is_a_target_and_device_cpu_is_taken(tmp_path, hub):
    runs = tmp_path / "runs"
    r = CliRunner().invoke(main, _args("Org/Tiny-Target", runs, "--device", "cpu"))
    assert r.exit_code == 0, r.output
    start = _start_event(runs)
    assert start["config"]["target"] == str(hub) and start["device"] == "cpu"
    # the default name: host, device, pid (distinct for every process on a host)
    assert start["instance"].endswith(f"-cpu-{os.getpid()}")


def test_a_hub_id_not_in_the_cache_says_so_and_how_to_fetch_it(tmp_path, hub):
    r = CliRunner().invoke(main, _args("Org/Not-Cached", tmp_path / "runs"))
    assert r.exit_code == 2
    assert "Org/Not-Cached" in r.output and "not in the local Hugging Face cache" in r.output
    assert "hf download Org/Not-Cached" in r.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("extra,message", [
    (["--device", "mps"], "the consumer trains on 'cpu', 'cuda' or 'cuda:N'"),
    (["--device", "cpu", "--gpu", "1"], "--gpu 1 and --device cpu name different devices"),
])
def test_a_device_the_consumer_cannot_use_is_refused_naming_it(tmp_path, target_dir, extra, message):
    r = CliRunner().invoke(main, _args(target_dir, tmp_path / "runs", *extra))
    assert r.exit_code == 2 and message in r.output, r.output
