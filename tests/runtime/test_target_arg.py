"""`--target` errors say what is wrong with the target and what to do, for dflash-produce,
dflash-consume and dflash-eval (issue 19, finding 9): a folder with a model but no
tokenizer is not blamed on sentencepiece/tiktoken, a folder without weights says so, a hub
ID missing from the local cache offline says to download it first or give a folder, and
the tools that read a local folder only say so for a hub ID."""

from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

from dflash.consumers.process.consume_command import main as consume_main
from dflash.producers.produce_command import main as produce_main
from dflash.tools.eval_command import main as eval_main
from dflash.tools.tiny import tiny_target

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("DFLASH_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may be downloaded; and the offline case


@pytest.fixture
def no_tokenizer(tmp_path):
    """A real model folder (config + weights of the tiny target) without its tokenizer."""
    src, d = tiny_target(), tmp_path / "model-only"
    d.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, d / name)
    return d


def _run(main, *args):
    r = CliRunner().invoke(main, list(args))
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert "--target" in r.output, r.output
    return r.output


def test_a_model_folder_without_a_tokenizer_says_so(no_tokenizer, tmp_path):
    for main, rest in ((produce_main, ["--data", "y"]), (eval_main, ["--drafter", str(tmp_path), "--prompts", "p"])):
        out = _run(main, "--target", str(no_tokenizer), *rest)
        assert "has no tokenizer files" in out and "tokenizer.save_pretrained" in out, out
        assert "sentencepiece" not in out and "tiktoken installed" not in out


def test_a_folder_with_a_config_but_no_weights_says_so(no_tokenizer):
    (no_tokenizer / "model.safetensors").unlink()
    for main, rest in ((produce_main, ["--data", "y"]), (consume_main, [])):
        out = _run(main, "--target", str(no_tokenizer), *rest)
        assert "has a config.json but no weights" in out, out


def test_a_hub_id_not_in_the_cache_offline_says_to_download_it_or_give_a_folder():
    out = _run(produce_main, "--target", "nobody-here/not-a-cached-model", "--data", "y")
    assert "hf download nobody-here/not-a-cached-model" in out and "model folder" in out, out


def test_every_tool_refuses_a_hub_id_that_is_not_cached_saying_how_to_fetch_it(tmp_path):
    # Hub IDs are taken wherever a target is (resolved from the local cache, nothing downloaded).
    for main, rest in ((consume_main, []), (eval_main, ["--drafter", str(tmp_path), "--prompts", "p"])):
        out = _run(main, "--target", "nobody-here/not-a-cached-model", *rest)
        assert "hf download nobody-here/not-a-cached-model" in out, out


def test_a_real_target_passes(tmp_path):
    """The check does not refuse a good folder: the tool goes past it (to the next error)."""
    r = CliRunner().invoke(eval_main, ["--target", str(tiny_target()), "--drafter", str(tmp_path / "none"),
                                       "--prompts", "p"])
    assert r.exit_code != 0 and "Invalid value for '--target'" not in r.output, r.output
