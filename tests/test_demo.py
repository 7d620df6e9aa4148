"""The README's local run, as a user runs it: `dflash-demo`, twice.

Checks what a newcomer would notice: the summary shows learning (loss down, acc and
streak up), every log line of the run passes `jq` and carries the run ID, and a second run
gets its own ID and folder while `runs/latest` moves to it.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

DEMO = [sys.executable, "-m", "dflash.tools.demo"]


def _demo(cwd, *args, timeout=400):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    res = subprocess.run(DEMO + list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run_id = re.search(r"^run (\d{8}T\d{6}Z-[0-9a-f]+):", res.stdout, re.M).group(1)
    return run_id, res.stdout


@pytest.mark.slow
def test_demo_learns_and_two_runs_stay_apart(tmp_path):
    first, out = _demo(tmp_path)
    run_dir = tmp_path / "runs" / first
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["loss_last"] < s["loss_first"] - 0.1, s
    assert s["acc_last"] > s["acc_first"] + 0.1, s
    assert s["streak_last"] > s["streak_first"], s
    assert s["samples"].get("committed") == 5 * 400, s["samples"]  # 5 epochs x 400 bundled chats
    assert "loss " in out and "jq -c" in out and str(run_dir.relative_to(tmp_path)) in out

    # every line of every log file parses with jq and has this run's ID
    logs = sorted((run_dir / "logs").glob("*.jsonl"))
    assert {p.name.split("-")[0] for p in logs} == {"broker", "producer", "consumer"}
    if shutil.which("jq"):
        for p in logs:
            ids = subprocess.run(["jq", "-r", ".run_id"], stdin=open(p), capture_output=True, text=True, check=True)
            assert set(ids.stdout.split()) == {first}, p
    for p in logs:
        assert {json.loads(line)["run_id"] for line in p.read_text().splitlines()} == {first}

    second, _ = _demo(tmp_path, "--epochs", "1")
    assert second != first
    assert os.readlink(tmp_path / "runs" / "latest") == second
    for rid in (first, second):
        for p in (tmp_path / "runs" / rid / "logs").glob("*.jsonl"):
            assert {json.loads(line)["run_id"] for line in p.read_text().splitlines()} == {rid}
