"""Long commands are never silent (issue 29, item 7): dflash-eval and the start-up of
dflash-produce (loading a target, transformers' own bars routed through runtime/progress.py)
draw a bar on a terminal (stderr a real pseudo-terminal) and none in a pipe, where the
progress is `progress.update` log lines and stdout stays what it was (eval: the report alone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig, published_config
from dflash.runtime.target_heads import TargetSpec
from dflash.producers.sample_data import CHATS_PATH
from dflash.runtime.targets import load_config
from dflash.tools.tiny import MASK_TOKEN, tiny_target
from tests.harness.terminal import on_a_terminal

pytestmark = pytest.mark.integration

BAR_MARKS = ("it/s", "|", "\r")  # what tqdm draws


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(OMP_NUM_THREADS="1", DFLASH_LOG_JSON="1", **kw)
    return env


def _on_a_terminal(argv: list[str], env: dict | None = None, timeout_s: float = 300) -> tuple[int, str, str]:
    return on_a_terminal(argv, env or _env(), timeout_s)


def _in_a_pipe(argv: list[str], env: dict | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, env=env or _env(), timeout=timeout_s)


def _json_lines(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.startswith("{")]


@pytest.fixture(scope="module")
def eval_setup(tmp_path_factory):
    """A tiny target, a drafter for it (random weights, the published layout) and 3 prompts."""
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("eval")
    target = tiny_target()
    spec = TargetSpec.from_config(load_config(target).to_dict())
    layers = [1, 2]
    torch.manual_seed(0)
    model = DFlashDraft(DrafterConfig.from_target(spec, 1, len(layers)))
    drafter = tmp / "drafter"
    drafter.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, drafter / "model.safetensors")
    mask = AutoTokenizer.from_pretrained(target).convert_tokens_to_ids(MASK_TOKEN)
    cfg = published_config(model.cfg, spec, block_size=4, mask_token_id=mask, target_layer_ids=layers)
    (drafter / "config.json").write_text(json.dumps(cfg))
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in range(3)))
    return target, drafter, prompts


def test_dflash_eval_shows_a_bar_on_a_terminal_and_log_lines_in_a_pipe(eval_setup):
    target, drafter, prompts = eval_setup
    argv = [sys.executable, "-m", "dflash.tools.eval_command", "--target", str(target), "--drafter", str(drafter),
            "--prompts", str(prompts), "--max-new-tokens", "8", "--json"]
    code, seen, out = _on_a_terminal(argv)
    assert code == 0, seen[-2000:]
    assert "eval: decode each prompt" in seen and "3/3" in seen and "tau=" in seen, seen[-2000:]
    assert f"load {target.name}: Loading weights" in seen, seen[-2000:]  # transformers' own bar, ours now
    assert json.loads(out)["prompts"] == 3  # stdout: the report alone
    r = _in_a_pipe(argv)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["prompts"] == 3
    assert not any(m in r.stderr for m in BAR_MARKS), r.stderr[-2000:]
    ends = [e for e in _json_lines(r.stderr) if e["event"] == "progress.update" and e["what"].startswith("eval")]
    assert ends and ends[-1]["done"] == ends[-1]["total"] == 3 and "tau" in ends[-1], r.stderr[-2000:]


def test_a_producers_target_load_shows_a_bar_on_a_terminal_and_nothing_raw_in_a_pipe(tmp_path):
    target = tiny_target()
    argv = [sys.executable, "-m", "dflash.producers.produce_command", "--dry-run", "--limit", "4", "--target", str(target),
            "--data", str(CHATS_PATH), "--device", "cpu", "--max-length", "256", "--token-budget", "512",
            "--runs-dir", str(tmp_path / "runs")]
    code, seen, out = _on_a_terminal(argv)
    assert code == 0, seen[-2000:]
    assert f"load {target.name}: Loading weights" in seen, seen[-2000:]
    assert all(x.startswith("{") for x in out.splitlines() if x.strip())  # stdout: the JSON log lines only
    r = _in_a_pipe(argv)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Loading weights" not in r.stderr and not any(m in r.stderr for m in BAR_MARKS), r.stderr[-2000:]


SLOW_LOAD = """
import sys, time
import dflash.runtime.progress as progress
from dflash.runtime.load_progress import load_bars
from dflash.runtime.logs import setup_logging
from transformers.utils import logging as hf_logging
import transformers.modeling_gguf_pytorch_utils as gguf_utils
progress.LOG_EVERY_S = 0.05
setup_logging("tool", "t")
with load_bars("load m", gguf_file=True):
    for _ in hf_logging.tqdm(range(4), desc="Loading weights"):
        time.sleep(0.1)
    for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
        time.sleep(0.1)
with load_bars("load m"):
    for _ in hf_logging.tqdm(range(2), desc="Loading weights"):  # short: no line of its own
        pass
assert hf_logging.set_tqdm_hook(None) is None  # the hook is gone after
assert gguf_utils.tqdm.__name__ != "<lambda>"  # and the GGUF reader's own name is back
"""


def test_transformers_bars_inside_a_load_become_ours(tmp_path):
    code, seen, _ = _on_a_terminal([sys.executable, "-c", SLOW_LOAD])
    assert code == 0, seen[-2000:]
    assert "load m: Loading weights" in seen and "4/4" in seen, seen
    assert "load m: Converting and de-quantizing GGUF tensors" in seen and "3/3" in seen, seen
    r = _in_a_pipe([sys.executable, "-c", SLOW_LOAD])
    assert r.returncode == 0 and not any(m in r.stderr for m in BAR_MARKS), r.stderr[-2000:]
    lines = [e for e in _json_lines(r.stdout) if e["event"] == "progress.update"]
    whats = {e["what"] for e in lines}
    assert whats == {"load m: Loading weights", "load m: Converting and de-quantizing GGUF tensors"}, whats
    assert {e["what"]: e["done"] for e in lines} == {"load m: Loading weights": 4,
                                                    "load m: Converting and de-quantizing GGUF tensors": 3}


TICKING = """
import time
import dflash.runtime.progress as progress
from dflash.runtime.logs import setup_logging
progress.LOG_EVERY_S = 0.2
setup_logging("tool", "t")
with progress.ticking("read big.gguf", every_s=0.05):
    time.sleep(1.0)
"""


def test_a_step_nothing_counts_shows_its_elapsed_time(tmp_path):
    code, seen, _ = _on_a_terminal([sys.executable, "-c", TICKING])
    assert code == 0 and "read big.gguf: " in seen and "elapsed" in seen, seen
    assert seen.count("read big.gguf") >= 3, seen  # redrawn while it ran, not only at its start and end
    r = _in_a_pipe([sys.executable, "-c", TICKING])
    lines = [e for e in _json_lines(r.stdout) if e["event"] == "progress.update"]
    assert r.returncode == 0 and len(lines) >= 3 and lines[-1]["what"] == "read big.gguf", r.stdout
