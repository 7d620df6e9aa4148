"""A run resumed to completion is not resumed again (issue 29, item 3): real brokers, fake
peers. Run A commits part of its samples and its broker is killed; run B resumes it and
finishes. Then `dflash-broker --resume A` is refused naming B, `dflash-status --run A`
points at B instead of offering a resume, B's view counts A's samples (item 6: not
"trained 24 committed 24 of 40" beside "every sample trained"), `--force-resume` does
branch off A, and a fresh broker nobody joined gives `runs/latest` back to B."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tests.harness.spawn import COMMITTING, finish, killed_part_way, spawn

pytestmark = pytest.mark.integration

N = 40


def _status(runs, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.tools.status_command", "--runs-dir", str(runs), "--timeout-s", "0.5",
                           *args], capture_output=True, text=True, timeout=60)


def _latest(runs) -> str:
    return os.readlink(runs / "latest")


def test_a_run_resumed_to_completion_is_not_resumed_again(brokers, tmp_path):
    runs = tmp_path / "runs"
    a, done = killed_part_way(brokers, N)
    inherited = len(done)
    assert 0 < inherited < N

    b = brokers("--resume", a.run_id)
    peers = [spawn(COMMITTING, "consumer", b, "--instance", "c"),
             spawn(COMMITTING, "producer", b, "--instance", "p", "--n-samples", str(N))]
    assert finish(peers, 60) == [0, 0] and b.proc.wait(15) == 0, [p.output[-2000:] for p in peers]
    assert _latest(runs) == b.run_id
    folders = sorted(p.name for p in runs.iterdir())

    # A second resume of A is refused before anything is made, naming B and what to do.
    r = subprocess.run([sys.executable, "-m", "dflash.broker.broker_command", "--runs-dir", str(runs), "--port", "1",
                        "--resume", a.run_id], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert f"run {a.run_id} was resumed already by run {b.run_id} (completed)" in r.stderr, r.stderr
    assert f"dflash-broker --resume {b.run_id} --epochs N" in r.stderr and "--force-resume" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in runs.iterdir()) == folders and _latest(runs) == b.run_id

    # The parent's view points to its child and offers no resume of its own.
    r = _status(runs, "--run", a.run_id)
    assert r.returncode == 0, r.stderr
    assert f"resumed by  {b.run_id}; that run: dflash-status --run {b.run_id}" in r.stdout, r.stdout
    assert "resume      dflash-broker" not in r.stdout, r.stdout
    d = json.loads(_status(runs, "--run", a.run_id, "--json").stdout)
    assert d["resumed_by"] == [b.run_id] and d["chain_end"] == {"run_id": b.run_id, "outcome": "completed"}

    # The child's view counts the samples it inherited: all of them trained, as its verdict says.
    r = _status(runs, "--run", "latest")
    assert r.returncode == 0 and "FINISHED" in r.stdout and "every sample trained" in r.stdout, r.stdout
    assert (f"samples     trained {N}  committed {N} (incl. {inherited} from the resumed run)  skipped 0  "
            f"of {N} (100.0%)") in r.stdout, r.stdout

    # Forced, a second branch off A starts (and, being a resumed run, keeps `latest`).
    c = brokers("--resume", a.run_id, "--force-resume")
    assert c.status["progress"]["inherited"] == inherited and c.status["progress"]["trained"] == inherited
    assert c.stop() == 0 and _latest(runs) == c.run_id

    # A fresh run that no producer or consumer joined gives `latest` back when it ends.
    empty = brokers()
    assert _latest(runs) == empty.run_id
    assert empty.stop() == 0
    assert _latest(runs) == c.run_id, "an empty run kept runs/latest"
    exit_line = next(json.loads(x) for x in empty.lines if '"broker.exit"' in x)
    assert exit_line["latest"] == c.run_id
    assert (runs / empty.run_id / "run.json").is_file()  # its folder stays: dflash-status --run ID
