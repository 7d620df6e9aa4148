"""A run that has nothing to train does not end as a success (issue 19, finding 7): an
empty data file, or rows none of which keeps a loss token (`--max-length 1`), end the
broker non-zero with outcome `nothing_to_train` and a line saying why, and
`dflash-status --run` says so (not "FINISHED ... every sample trained")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.producers.helpers import chat, write_jsonl
from tests.harness.tiny import tiny_dir

from tests.harness.broker import BrokerProc

pytestmark = pytest.mark.integration


def _produce(b: BrokerProc, data: str, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "dflash.producers.produce_command", "--broker", b.control, "--target",
                           str(tiny_dir("qwen3", False)), "--data", data, "--device", "cpu", "--runs-dir",
                           str(b.runs_dir), "--no-check-packing", *extra],
                          capture_output=True, text=True, timeout=120, env=env)


def _status(b: BrokerProc) -> dict:
    r = subprocess.run([sys.executable, "-m", "dflash.tools.status_command", "--run", b.run_id, "--runs-dir",
                        str(b.runs_dir), "--json", "--timeout-s", "0.2"], capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["empty_file", "no_loss_tokens"])
def test_a_run_with_nothing_to_train_ends_non_zero_saying_why(case, tmp_path):
    if case == "empty_file":
        data, extra, why = str(tmp_path / "empty.jsonl"), (), "the dataset has 0 samples"
        Path(data).write_text("")
    else:
        data = write_jsonl(tmp_path / "chats.jsonl", [chat(i) for i in range(6)])
        extra, why = ("--max-length", "1"), "every sample was skipped (6 no_loss_tokens"
    b = BrokerProc(tmp_path / "runs", [])
    try:
        p = _produce(b, data, *extra)
        assert p.returncode == 0, p.stderr[-2000:]
        code = b.proc.wait(30)
    finally:
        if b.proc.poll() is None:
            b.proc.kill()
    assert code == 3, b.stderr
    assert "nothing to train" in b.stderr[-1] and why in b.stderr[-1], b.stderr
    info = json.loads((b.run_dir / "run.json").read_text())
    assert info["outcome"] == "nothing_to_train" and why in info["reason"]
    (line,) = b.events("broker.nothing_to_train")
    assert line["level"] == "error" and why in line["why"]
    st = _status(b)
    assert st["verdict"] == "NOTHING_TRAINED" and why in st["why"] and "every sample trained" not in st["why"]
