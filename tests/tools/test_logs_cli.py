"""dflash-logs over real log files written by the project's own logger (in subprocesses)."""

import json
import subprocess
import sys
import textwrap

from click.testing import CliRunner

from dflash.runtime.run import make_run_dir, new_run_id, point_latest
from dflash.tools.logs_command import main
import pytest

pytestmark = pytest.mark.integration


def _write_role_logs(runs_dir, run_id, role, instance, events):
    code = textwrap.dedent(f"""
        import time
        from dflash.runtime.logs import setup_logging, bind_run, get_logger
        setup_logging({role!r}, {instance!r})
        bind_run({run_id!r}, {str(runs_dir)!r})
        log = get_logger()
        for name, level in {events!r}:
            getattr(log, level)(name)
            time.sleep(0.01)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def _two_runs(tmp_path):
    old, new = new_run_id(1_700_000_000), new_run_id(1_700_000_900)
    for r in (old, new):
        make_run_dir(r, tmp_path)
    _write_role_logs(tmp_path, old, "consumer", "c0", [("train.oom", "error")])
    _write_role_logs(tmp_path, new, "broker", "b0", [("broker.start", "info"), ("broker.stop", "info")])
    _write_role_logs(tmp_path, new, "consumer", "c0", [("train.step", "info"), ("train.step", "info")])
    point_latest(new, tmp_path)
    return old, new


def test_latest_run_merged_in_time_order_and_named(tmp_path):
    old, new = _two_runs(tmp_path)
    res = CliRunner().invoke(main, ["--runs-dir", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    assert f"# run {new}" in res.stderr
    evs = [json.loads(line) for line in res.stdout.splitlines()]
    assert {e["run_id"] for e in evs} == {new}          # the old run's OOM never shows
    assert [e["ts"] for e in evs] == sorted(e["ts"] for e in evs)
    assert {e["role"] for e in evs} == {"broker", "consumer"}


def test_filters_and_explicit_old_run(tmp_path):
    old, new = _two_runs(tmp_path)
    r = CliRunner().invoke(main, ["--runs-dir", str(tmp_path), "--json", "--event", "train"])
    assert [json.loads(line)["event"] for line in r.stdout.splitlines()] == ["train.step", "train.step"]
    r = CliRunner().invoke(main, ["--runs-dir", str(tmp_path), "--json", "--role", "broker", "--level", "info"])
    assert [json.loads(line)["event"] for line in r.stdout.splitlines()] == ["broker.start", "broker.stop"]
    r = CliRunner().invoke(main, ["--runs-dir", str(tmp_path), "--run", old, "--json"])
    assert [json.loads(line)["event"] for line in r.stdout.splitlines()] == ["train.oom"]


def test_unknown_run_is_a_one_line_error(tmp_path):
    r = CliRunner().invoke(main, ["--runs-dir", str(tmp_path), "--run", "nope"])
    assert r.exit_code == 2 and "no run 'nope'" in r.stderr
