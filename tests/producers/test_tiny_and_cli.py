"""tools/tiny.py targets, the bundled sample data, and the dflash-produce command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from tests.producers.helpers import chat, write_jsonl
from tests.harness.tiny import tiny_dir

from dflash.producers.produce_command import main
from dflash.producers.sample_data import CHATS_PATH, generate_chats
from dflash.tools.tiny import MASK_TOKEN, tiny_target

pytestmark = pytest.mark.integration


def test_tiny_target_loads_like_a_checkpoint_and_is_cached(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_target(tmp_path, family="llama", tie=True, layers=4)
    stamp = (path / "config.json").stat().st_mtime_ns
    assert tiny_target(tmp_path, family="llama", tie=True, layers=4) == path
    assert (path / "config.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 4
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert 300 <= len(tok) <= 2048 and model.config.vocab_size >= len(tok)
    with pytest.raises(ValueError, match="unknown family"):
        tiny_target(tmp_path, family="gpt5")


def test_mask_token_is_reserved_and_unused_by_the_data(tokenizer):
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    assert mask_id not in (tokenizer.unk_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id, None)
    for c in generate_chats(50):
        text = tokenizer.apply_chat_template(c["messages"], tokenize=False)
        assert mask_id not in tokenizer(text, add_special_tokens=False)["input_ids"]


def test_bundled_sample_data_is_the_generators_output():
    lines = CHATS_PATH.read_text().splitlines()
    assert [json.loads(x) for x in lines] == generate_chats()
    assert len(lines) >= 300
    assert all(len([m for m in c["messages"] if m["role"] == "assistant"]) > 1 for c in generate_chats())


def test_help_explains_every_option():
    res = CliRunner().invoke(main, ["--help"], terminal_width=200)
    assert res.exit_code == 0
    for param in main.params:
        if param.name == "help":
            continue
        assert param.help, param.name
        assert param.opts[0] in res.output
    assert "DFLASH_PRODUCE_TOKEN_BUDGET" in res.output


def _run(*args):
    return subprocess.run([sys.executable, "-m", "dflash.producers.produce_command", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "DFLASH_LOG_JSON": "1"})


# The command runs in a subprocess (its logging setup is process-wide); one family is
# enough here, the library tests cover both.


def test_dry_run_over_the_bundled_data():
    res = _run("--target", str(tiny_dir("qwen3", False)), "--data", str(CHATS_PATH), "--device", "cpu", "--dry-run",
               "--limit", "60", "--token-budget", "1024", "--max-length", "512")
    assert res.returncode == 0, res.stderr[-2000:]
    events = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    done = [e for e in events if e["event"] == "produce.done"][0]
    assert done["samples"] == 60 and done["skipped"] == 0
    assert any(e["event"] == "produce.packing_check" and e["ok"] for e in events)


def test_bad_input_exits_nonzero_with_one_line(tmp_path):
    tiny = tiny_dir("qwen3", False)
    res = _run("--target", str(tiny), "--data", "x.jsonl", "--token-budget", "100", "--max-length", "200")
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1].startswith("error: --max-length 200 exceeds")
    bad = write_jsonl(tmp_path / "d.jsonl", [chat(0)], raw_lines=["{oops"])
    res = _run("--target", str(tiny), "--data", bad, "--device", "cpu", "--dry-run", "--no-check-packing")
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1].startswith(f"error: {bad}:2: invalid JSON")
