"""A producer that stops on a bad row tells the broker why before it leaves (issue 29,
item 4): the broker's diagnosis and `dflash-status` show the cause (the file and line) and
the fix (`--skip-bad-rows`), not "no target connected -> start dflash-produce". A real
broker process and a real `dflash-produce` on a tiny target."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness.broker import BrokerProc
from tests.harness.tiny import tiny_dir
from tests.producers.helpers import chat, write_jsonl

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
def test_a_producer_stopped_by_a_bad_row_leaves_its_cause_and_fix_in_status(tmp_path):
    data = write_jsonl(tmp_path / "chats.jsonl", [chat(i) for i in range(5)], raw_lines=['{"messages": [oops'])
    b = BrokerProc(tmp_path / "runs", ["--timeout-s", "30"])
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
        env.update(OMP_NUM_THREADS="1")
        p = subprocess.run([sys.executable, "-m", "dflash.producers.produce_command", "--broker", b.control, "--target",
                            str(tiny_dir("qwen3", False)), "--data", data, "--device", "cpu", "--runs-dir",
                            str(b.runs_dir), "--instance", "p-bad", "--no-check-packing"],
                           capture_output=True, text=True, timeout=150, env=env)
        assert p.returncode == 1 and f"{data}:6: invalid JSON" in p.stderr, p.stderr[-1500:]
        left = b.wait_event("broker.peer_failed")
        assert left["peer_instance"] == "p-bad" and left["code"] == "bad_row" and left["source"] == f"{data}:6"
        st = b.ask()
        d = st["diagnosis"]
        assert d["code"] == "peer_failed", d
        assert f"{data}:6" in d["text"] and "p-bad" in d["text"] and "--skip-bad-rows" in d["suggestion"], d
        assert "no target connected" not in d["text"]
        gone = st["gone"][-1]
        assert gone["failure"]["code"] == "bad_row" and gone["failure"]["source"] == f"{data}:6"
        # and as a person reads it
        r = subprocess.run([sys.executable, "-m", "dflash.tools.status_command", "--broker", b.control, "--timeout-s", "5"],
                           capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0, r.stderr
        assert f"{data}:6" in r.stdout and "--skip-bad-rows" in r.stdout and "bad_row" in r.stdout, r.stdout
        assert json.loads(json.dumps(st))  # nothing in the map that JSON cannot carry
    finally:
        b.stop()
