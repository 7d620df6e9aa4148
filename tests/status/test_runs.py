"""Live state and history are never confused (docs/DESIGN.md incidents 3 and 5): after a
restart in the same runs folder, status and logs show only the new run, and the old run's
OOM never appears in its view; `dflash-status --run` says plainly that a run finished,
stopped or died, when, and at which step, and never presents it as live."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

from tests.harness.broker import ask_status
from tests.status.helpers import rows, status, status_json
from tests.harness.wait import wait_for
import pytest

pytestmark = pytest.mark.integration


def _logs(runs_dir, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.tools.logs_command", "--runs-dir", str(runs_dir), *args],
                          capture_output=True, text=True, timeout=60)


def _steps_at_least(b, instance: str, n: int, timeout_s: float = 20) -> dict:
    return wait_for(lambda: ask_status(b.control),
                    lambda st: ((rows(st, "consumer").get(instance) or {}).get("step") or 0) >= n, timeout_s)


def test_restart_shows_only_the_new_run_then_verdicts_on_both(start_broker, fakes):
    # run A: its drafter logs an OOM at step 3 and dies; the broker is then stopped (SIGTERM)
    a = start_broker()
    runs = a.runs_dir
    fakes("producer", a, "--instance", "tgt0", "--gpu", "0", "--delay-s", "0.02")
    fakes("consumer", a, "--instance", "dft5", "--gpu", "5", "--train-s", "0.05", "--oom-at-step", "3")
    wait_for(lambda: ask_status(a.control), lambda st: any(g["instance"] == "dft5" for g in st["gone"]), 20)
    assert a.stop() == 0

    # run B in the same runs folder, a drafter of the same name
    b = start_broker()
    fakes("producer", b, "--instance", "tgt0", "--gpu", "0", "--delay-s", "0.02")
    fakes("consumer", b, "--instance", "dft5", "--gpu", "5", "--train-s", "0.05")
    _steps_at_least(b, "dft5", 4)

    st = status_json("--broker", b.control)
    assert st["run_id"] == b.run_id != a.run_id
    assert st["gone"] == [] and st["diagnosis"]["code"] != "peer_lost"
    human = status("--broker", b.control).stdout
    assert a.run_id not in human and "GONE" not in human and " lost " not in human

    shown = _logs(runs, "--json")  # default: the latest run, named on stderr
    assert f"# run {b.run_id}" in shown.stderr
    events = [json.loads(x) for x in shown.stdout.splitlines()]
    assert events and {e["run_id"] for e in events} == {b.run_id}
    assert not [e for e in events if e["event"] == "train.oom" or e["level"] == "error"]
    assert "train.oom" in _logs(runs, "--run", a.run_id, "--json").stdout  # it is there, in A's view only

    live = status_json("--run", "latest", "--runs-dir", str(runs))
    assert live["verdict"] == "LIVE" and live["run_id"] == b.run_id and live["status"]["run_id"] == b.run_id

    old = status("--run", a.run_id, "--runs-dir", str(runs), "--broker", b.control)
    assert old.returncode == 0, old.stderr
    first = old.stdout.splitlines()[0]
    assert first.startswith(f"run {a.run_id}  STOPPED ") and "NOT LIVE" in first and "SIGTERM" in first
    assert f"serves another run, {b.run_id}" in old.stdout  # --broker answered for B, not A
    assert re.search(r"errors +\d+ error lines in this run's logs", old.stdout) and "LIVE (" not in old.stdout
    old_json = status_json("--run", a.run_id, "--runs-dir", str(runs))
    assert old_json["live"] is False and old_json["verdict"] == "STOPPED" and old_json["last_step"] == 3

    # B's broker is SIGKILLed: no end is recorded, and nothing answers: DIED, at its last line
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(5)  # reaped: a zombie's pid would still look alive
    died = status_json("--run", "latest", "--runs-dir", str(runs), "--timeout-s", "0.5")
    assert died["verdict"] == "DIED" and died["live"] is False and died["outcome"] == "running"
    logged = [json.loads(x)["step"] for x in (b.run_dir / "logs" / "consumer-dft5.jsonl").read_text().splitlines()
              if '"train.step"' in x]
    assert died["last_step"] == max(logged) and died["at"] == died["last_seen_at"]
    assert any("does not answer" in n for n in died["notes"])
    text = status("--run", "latest", "--runs-dir", str(runs), "--timeout-s", "0.5").stdout
    assert text.startswith(f"run {b.run_id}  DIED ") and f"last step   {max(logged)}" in text
    assert f"dflash-broker --resume {b.run_id}" in text


def test_finished_run_says_finished_with_its_last_step(start_broker, fakes):
    b = start_broker("--num-samples", "24")
    fakes("producer", b, "--instance", "tgt0", "--n-samples", "24")
    fakes("consumer", b, "--instance", "dft5", "--commit-every", "2")
    assert b.proc.wait(30) == 0
    d = status_json("--run", b.run_id, "--runs-dir", str(b.runs_dir), "--timeout-s", "0.5")
    assert d["verdict"] == "FINISHED" and d["live"] is False and d["outcome"] == "completed"
    assert d["last_step"] == 12 and d["ledger"]["samples"] == {"committed": 24}  # 2 samples a batch
    assert d["samples_total"] == 24 and d["at"] == d["ended_at"]
    text = status("--run", "latest", "--runs-dir", str(b.runs_dir), "--timeout-s", "0.5").stdout
    assert text.startswith(f"run {b.run_id}  FINISHED ") and "end of stream" in text


def test_no_broker_points_at_the_latest_run_and_unknown_runs_fail(start_broker, tmp_path):
    b = start_broker()
    b.stop()
    r = status("--broker", b.control, "--runs-dir", str(b.runs_dir), "--timeout-s", "0.3")
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert f"latest run under {b.runs_dir} is {b.run_id} (dflash-status --run latest)" in r.stderr
    r = status("--run", "20200101T000000Z-0000", "--runs-dir", str(b.runs_dir))
    assert r.returncode == 1 and "no run" in r.stderr
    r = status("--run", "latest", "--watch", "1")
    assert r.returncode == 2 and "leave out --run" in r.stderr


def test_a_frozen_broker_is_unresponsive_never_live(start_broker):
    b = start_broker()
    b.proc.send_signal(signal.SIGSTOP)  # alive, holding its ports, answering nothing
    try:
        d = status_json("--run", b.run_id, "--runs-dir", str(b.runs_dir), "--timeout-s", "0.5")
    finally:
        b.proc.send_signal(signal.SIGCONT)
    assert d["verdict"] == "UNRESPONSIVE" and d["live"] is False and d["alive_pids"] == [b.proc.pid]
    assert b.stop() == 0
