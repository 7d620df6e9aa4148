"""Inconsistencies a new user met (issue 20): `dflash-eval --drafter latest` works like
`dflash-export latest`; a broker that fails to start leaves no run folder behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from click.testing import CliRunner

from dflash.tools.tiny import tiny_target
import pytest

pytestmark = pytest.mark.integration

CLEAN = {k: None for k in os.environ if k.startswith("DFLASH_")}


def test_eval_takes_latest_as_export_does(tmp_path):
    from dflash.consumers.process.consume_command import main as consume
    from dflash.tools.eval_command import main as evaluate

    target, runs = tiny_target(), tmp_path / "runs"
    r = CliRunner().invoke(consume, ["--target", str(target), "--runs-dir", str(runs), "--draft-layers", "1",
                                     "--block-size", "4", "--anchors", "4", "--synthetic-seq-len", "32",
                                     "--synthetic-seqs", "2", "--synthetic-batches", "2", "--save-every", "0"], env=CLEAN)
    assert r.exit_code == 0, r.output
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Hello there"}) + "\n")
    r = CliRunner().invoke(evaluate, ["--target", str(target), "--drafter", "latest", "--runs-dir", str(runs),
                                      "--prompts", str(prompts), "--max-new-tokens", "4", "--json"], env=CLEAN)
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["mismatches"] == [] and rep["new_tokens"] > 0

    r = CliRunner().invoke(evaluate, ["--target", str(target), "--drafter", "latest", "--runs-dir",
                                      str(tmp_path / "none"), "--prompts", str(prompts)], env=CLEAN)
    assert r.exit_code == 2 and "--drafter latest: no checkpoint" in r.output, r.output


def test_a_broker_that_cannot_bind_leaves_no_run_folder(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    runs = tmp_path / "runs"
    try:
        r = subprocess.run([sys.executable, "-m", "dflash.broker.broker_command", "--bind", "127.0.0.1", "--port", str(port),
                            "--runs-dir", str(runs)], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")})
    finally:
        busy.close()
    assert r.returncode == 1 and "cannot bind" in r.stderr, r.stderr
    assert '"broker.start_failed"' in r.stdout  # the JSON line still says why
    left = [p.name for p in runs.iterdir()] if runs.exists() else []
    assert left == [], f"a failed start left {left} in {runs}"
