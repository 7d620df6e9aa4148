"""`--help` answers at once (issue 20: `dflash-consume --help` took ~3.8 s, importing torch
before parsing). The click commands of the roles live in <script>_command.py modules that import
neither torch nor transformers; `-h` works on every command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib.metadata import distribution
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPTS = {ep.name: ep.value for ep in distribution("dflash-pipeline").entry_points if ep.group == "console_scripts"}
LIGHT = sorted(SCRIPTS)

PROBE = """
import json, sys
from importlib.metadata import distribution
ep = next(e for e in distribution("dflash-pipeline").entry_points if e.name == sys.argv[1])
try:
    ep.load()([sys.argv[2]], prog_name=sys.argv[1])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "heavy": sorted(m for m in ("torch", "transformers", "torchft", "matplotlib")
                                                 if m in sys.modules)}))
"""


def _probe(script: str, flag: str) -> tuple[dict, str]:
    r = subprocess.run([sys.executable, "-c", PROBE, script, flag], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")})
    *help_lines, last = r.stdout.rstrip("\n").splitlines()
    return json.loads(last), "\n".join(help_lines)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_dash_h_is_help_on_every_command(script):
    got, text = _probe(script, "-h")
    assert got["code"] in (0, None) and "Usage:" in text and "-h, --help" in text, (script, got, text[:300])


@pytest.mark.parametrize("script", LIGHT)
def test_help_imports_no_model_library(script):
    got, _ = _probe(script, "--help")
    assert got["heavy"] == [], f"{script} --help imported {got['heavy']}"


def test_consume_help_is_quick():
    exe = Path(sys.executable).parent / "dflash-consume"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "from dflash.consumers.consume_command import main; main()"]
    best = min(_timed([*cmd, "--help"]) for _ in range(2))
    # under 1 s on the dev VM; generous for a loaded CI machine (torch alone took ~3 s here)
    assert best < 2.5, f"dflash-consume --help took {best:.2f} s"


def _timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return time.perf_counter() - t
