"""`--help` answers at once (issue 20: `dflash-consume --help` took ~3.8 s, importing torch
before parsing). The click commands of the roles live in <script>_command.py modules that import
neither torch nor transformers; `-h` works on every command. Options that cannot work
together are refused as early, before torch loads (issue 29: `--token-budget 1024` with the
default `--max-length` took 12-27 s to be refused). Asserted on what was imported, not on
seconds: a wall-clock bound flakes on a loaded machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import distribution

import pytest
from tests.harness.tiny import tiny_dir

pytestmark = pytest.mark.integration

SCRIPTS = {ep.name: ep.value for ep in distribution("dflash-pipeline").entry_points if ep.group == "console_scripts"}
LIGHT = sorted(SCRIPTS)

PROBE = """
import json, sys
from importlib.metadata import distribution
ep = next(e for e in distribution("dflash-pipeline").entry_points if e.name == sys.argv[1])
code = None
try:
    ep.load()(sys.argv[2:], prog_name=sys.argv[1])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "heavy": sorted(m for m in ("torch", "transformers", "torchft", "matplotlib")
                                                 if m in sys.modules), "modules": len(sys.modules)}))
"""


def _probe(script: str, *args: str) -> tuple[dict, str]:
    r = subprocess.run([sys.executable, "-c", PROBE, script, *args], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")})
    *help_lines, last = r.stdout.rstrip("\n").splitlines()
    got = json.loads(last)
    got["stderr"] = r.stderr
    return got, "\n".join(help_lines)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_dash_h_is_help_on_every_command(script):
    got, text = _probe(script, "-h")
    assert got["code"] in (0, None) and "Usage:" in text and "-h, --help" in text, (script, got, text[:300])


@pytest.mark.parametrize("script", LIGHT)
def test_help_imports_no_model_library(script):
    got, _ = _probe(script, "--help")
    assert got["heavy"] == [], f"{script} --help imported {got['heavy']}"


# Modules `dflash-consume --help` may load: what it needs is a couple of hundred; torch alone
# brings over a thousand, numpy a hundred and more, so a heavy import cannot hide under it.
LIGHT_MODULES = 300


def test_consume_help_is_quick():
    got, text = _probe("dflash-consume", "--help")
    assert got["code"] in (0, None) and "Usage:" in text
    assert got["heavy"] == [] and got["modules"] < LIGHT_MODULES, got


@pytest.mark.parametrize("script, args, says", [
    ("dflash-produce", ["--token-budget", "1024"], "--max-length 3072 exceeds --token-budget 1024"),
    ("dflash-produce", ["--limit", "3"], "--limit only applies to --dry-run"),
    ("dflash-consume", ["--eval-prompts", "{prompts}"], "give --eval-every N too"),
])
def test_options_that_cannot_work_together_are_refused_before_torch_loads(script, args, says, tmp_path):
    target_dir = tiny_dir("qwen3", False)  # a whole model folder: --target passes its check
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "hello"}\n')
    args = [a.format(prompts=data) for a in args]
    extra = ["--data", str(data)] if script == "dflash-produce" else []
    got, _ = _probe(script, "--target", str(target_dir), *extra, *args)
    assert got["code"] == 2 and says in got["stderr"], got
    assert len(got["stderr"].strip().splitlines()) == 1, got["stderr"]
    assert got["heavy"] == [], f"{script} {' '.join(args)} imported {got['heavy']} before refusing"
