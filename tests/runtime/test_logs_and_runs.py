"""Run identity and log files: the rules that keep live and historical state apart."""

import json
import os
import subprocess
import sys
import textwrap

from dflash.runtime.run import is_run_id, make_run_dir, new_run_id, point_latest, resolve_run
import pytest

pytestmark = pytest.mark.integration

REQUIRED = ("ts", "level", "event", "run_id", "role", "instance", "host", "pid")


def test_run_ids_sort_by_time_and_are_unique():
    a, b = new_run_id(1_700_000_000), new_run_id(1_700_000_001)
    assert is_run_id(a) and is_run_id(b)
    assert a < b
    assert len({new_run_id(1_700_000_000) for _ in range(50)}) > 40  # random suffix


def test_latest_points_to_newest_run(tmp_path):
    first, second = new_run_id(1_700_000_000), new_run_id(1_700_000_100)
    for r in (first, second):
        make_run_dir(r, tmp_path)
        point_latest(r, tmp_path)
    assert os.readlink(tmp_path / "latest") == second
    assert resolve_run(None, tmp_path) == (tmp_path / second).resolve()
    assert resolve_run(first, tmp_path) == (tmp_path / first).resolve()


def _log_in_subprocess(runs_dir, run_id, role="producer", instance="hostA-gpu0"):
    code = textwrap.dedent(f"""
        from dflash.runtime.logs import setup_logging, bind_run, get_logger, close_logging
        setup_logging({role!r}, {instance!r}, gpu=3)
        log = get_logger()
        log.info("test.before_run", x=1)          # before the run is known: buffered
        path = bind_run({run_id!r}, {str(runs_dir)!r})
        log.warning("test.after_run", y=[1, 2])
        try:
            1 / 0
        except ZeroDivisionError:
            log.exception("test.failed")
        close_logging()
        print("PATH", path)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout


def test_every_line_is_json_with_identity_fields(tmp_path):
    run_id = new_run_id()
    stdout = _log_in_subprocess(tmp_path, run_id)
    path = tmp_path / run_id / "logs" / "producer-hostA-gpu0.jsonl"
    lines = [json.loads(rec) for rec in path.read_text().splitlines()]
    assert [rec["event"] for rec in lines] == ["test.before_run", "test.after_run", "test.failed"]
    for rec in lines:
        for k in REQUIRED:
            assert rec.get(k) is not None, (k, rec)
        assert rec["run_id"] == run_id and rec["gpu"] == 3
        assert rec["ts"].endswith("Z") and len(rec["ts"]) == len("2026-11-29T15:48:12.123Z")
    assert lines[1]["level"] == "warning" and lines[1]["y"] == [1, 2]
    assert "ZeroDivisionError" in lines[2]["exception"]
    # stdout (not a TTY here) carries the same JSON lines
    json_lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert [rec["event"] for rec in json_lines] == ["test.before_run", "test.after_run", "test.failed"]


def test_two_runs_never_share_a_log_file(tmp_path):
    r1, r2 = new_run_id(1_700_000_000), new_run_id(1_700_000_500)
    _log_in_subprocess(tmp_path, r1)
    _log_in_subprocess(tmp_path, r2)
    f1 = tmp_path / r1 / "logs" / "producer-hostA-gpu0.jsonl"
    f2 = tmp_path / r2 / "logs" / "producer-hostA-gpu0.jsonl"
    assert f1 != f2
    assert {json.loads(line)["run_id"] for line in f1.read_text().splitlines()} == {r1}
    assert {json.loads(line)["run_id"] for line in f2.read_text().splitlines()} == {r2}


def test_lines_of_a_closed_run_never_reach_the_next_runs_file(tmp_path):
    """Two runs made one after the other in one process (as CliRunner tests do): a line
    logged after the first run's close_logging (a direct train() call, say) stayed in the
    buffer of lines before any run and was written into the second run's file."""
    code = textwrap.dedent(f"""
        import io
        from dflash.runtime.logs import bind_run, close_logging, get_logger, setup_logging
        log = get_logger()
        setup_logging("consumer", "a", stream=io.StringIO())
        bind_run({new_run_id(1_700_000_000)!r}, {str(tmp_path)!r})
        log.info("test.in_first")
        close_logging()
        log.info("test.after_first")  # reaches stdout only: no run is open
        setup_logging("consumer", "b", stream=io.StringIO())
        log.info("test.held")  # before the run is known: held for its file
        bind_run({new_run_id(1_700_000_500)!r}, {str(tmp_path)!r})
        log.info("test.in_second")
        close_logging()
        # a configuration made anew also drops what an earlier one held unbound
        setup_logging("consumer", "c", stream=io.StringIO())
        log.info("test.never_bound")
        setup_logging("consumer", "c", stream=io.StringIO())
        bind_run({new_run_id(1_700_001_000)!r}, {str(tmp_path)!r})
        log.info("test.in_third")
        close_logging()
    """)
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    events = {}
    for f in sorted(tmp_path.glob("*/logs/*.jsonl")):
        events[f.name] = [json.loads(line)["event"] for line in f.read_text().splitlines()]
    assert events == {"consumer-a.jsonl": ["test.in_first"], "consumer-b.jsonl": ["test.held", "test.in_second"],
                      "consumer-c.jsonl": ["test.in_third"]}
