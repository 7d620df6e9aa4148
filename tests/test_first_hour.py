"""A new user's first hour (issue 36, finding 8), each case through the real command: a
missing --target of dflash-prompts is a clean usage error (no traceback), a wrong --broker is
said before the target loads and names the address, a missing .gguf is "no such file", rank 1
of a group does not print "last checkpoint None", and dflash-prompts' progress moves while
candidates and answers decode (before a prompt is kept) and its last line is logged once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dflash.protocol.peer import dial_broker
from dflash.protocol.sockets import free_port_block
from dflash.tools import real_target
from tests.harness.terminal import on_a_terminal
from tests.harness.tiny import tiny_dir

pytestmark = pytest.mark.integration

BIN = os.path.dirname(sys.executable)


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(DFLASH_LOG_JSON="1", OMP_NUM_THREADS="1", **kw)
    return env


def _run(argv: list[str], timeout: float = 120, cwd=None) -> tuple[int, str, float]:
    """(exit code, stdout + stderr, seconds) of a command."""
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=cwd)
    return r.returncode, r.stdout + r.stderr, time.monotonic() - t0


def _cmd(name: str) -> str:
    return os.path.join(BIN, name)


def test_a_missing_prompts_target_is_a_clean_usage_error(tmp_path):
    rc, out, took = _run([_cmd("dflash-prompts"), "--target", str(tmp_path / "nope"), "--out",
                          str(tmp_path / "p.jsonl"), "--count", "1"])
    assert rc == 2 and "Traceback" not in out, out
    assert f"{tmp_path / 'nope'}: no such folder" in out and "--target" in out, out
    assert took < 20, took  # refused before torch and the target load


def test_a_missing_gguf_is_no_such_file(tmp_path):
    # models/x.gguf: a relative path with one slash, as a hub ID has
    for target in (str(tmp_path / "model.gguf"), "models/x.gguf"):
        for argv in ([_cmd("dflash-produce"), "--target", target, "--data", "d.jsonl"],
                     [_cmd("dflash-consume"), "--target", target],
                     [_cmd("dflash-prompts"), "--target", target, "--out", "p.jsonl", "--count", "1"]):
            rc, out, _ = _run(argv, cwd=tmp_path)
            assert rc == 2 and f"{target}: no such file" in out, (argv, out)
            assert "folder" not in out.split("--target")[-1] and "Traceback" not in out, (argv, out)


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    return path


def test_a_wrong_broker_is_said_before_the_target_loads(data):
    target = str(tiny_dir("qwen3", False))
    closed = f"tcp://127.0.0.1:{free_port_block(1)}"  # nothing listens there
    for role in ("produce", "consume"):
        extra = ["--data", str(data)] if role == "produce" else []
        # a host that does not resolve: bad input, at once
        rc, out, took = _run([_cmd(f"dflash-{role}"), "--broker", "tcp://brokr.invalid:5555", "--target", target,
                              *extra])
        assert rc == 2 and "broker tcp://brokr.invalid:5555: host 'brokr.invalid' is not known" in out, out
        assert f"{role}.start" not in out and took < 25, (took, out)  # no log line of the start, no load
    # a port nothing listens on: said after the dial's 30 s, not after the target's load and then 30 s
    rc, out, took = _run([_cmd("dflash-produce"), "--broker", closed, "--target", target, "--data", str(data)])
    assert rc == 1 and f"broker {closed} did not answer within 30s (connection refused" in out, out
    assert "produce.start" not in out and took < 60, (took, out)


def test_the_dial_completes_a_handshake_the_broker_does_not_log_as_a_failure(start_broker):
    broker = start_broker()
    t0 = time.monotonic()
    dial_broker(broker.control, timeout_s=10)
    assert time.monotonic() - t0 < 5
    time.sleep(0.5)  # the broker's loop reads its monitor each turn
    assert broker.proc.poll() is None and not broker.events("broker.handshake_failed"), broker.lines[-5:]


def test_rank_1_says_who_writes_checkpoints_not_none(tmp_path):
    target = str(tiny_dir("qwen3", False))
    port = free_port_block(1)
    procs = [subprocess.Popen([_cmd("dflash-consume"), "--target", target, "--synthetic-batches", "2",
                               "--synthetic-seqs", "2", "--synthetic-seq-len", "64", "--dist-init",
                               f"tcp://127.0.0.1:{port}", "--rank", str(r), "--world-size", "2", "--runs-dir",
                               str(tmp_path / "runs")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env()) for r in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    done = [next(x for x in err.splitlines() if x.startswith("done:")) for _, err in outs]
    assert "None" not in done[1] and "rank 1: checkpoints are written by rank 0" in done[1], done
    assert "last checkpoint" in done[0] and "step-2" in done[0], done
    for out, _ in outs:  # each consumer raised its open-file limit at start (issue 36, finding 6)
        (ev,) = [x for x in map(json.loads, (x for x in out.splitlines() if x.startswith("{")))
                 if x["event"] == "process.open_files"]
        assert ev["role"] == "consumer" and ev["soft"] == ev["hard"], ev


def _prompts(out, *args, tty=False):
    cmd = [_cmd("dflash-prompts"), "--target", str(real_target.hf_folder()), "--out", str(out), "--max-new-tokens",
           "48", "--answer-tokens", "32", "--batch-size", "4", "--families", "follow_up", "--count", "1", *args]
    env = _env(DFLASH_PROGRESS_EVERY_S="0")  # a line at every move: the first ones come before a prompt is kept
    if tty:
        rc, err, _ = on_a_terminal(cmd, env, 600)
        return rc, err
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    return r.returncode, r.stderr


@pytest.mark.real_target
@pytest.mark.slow
def test_prompts_progress_moves_with_the_decoding_and_ends_in_one_line(tmp_path):
    rc, err = _prompts(tmp_path / "p.jsonl")
    assert rc == 0, err[-3000:]
    prog = [x for x in map(json.loads, (x for x in err.splitlines() if x.startswith("{")))
            if x["event"] == "progress.update" and x["what"] == "prompts"]
    before = [p for p in prog if p["done"] == 0]
    # a follow-up is a request, an answer and a second request before it can be kept
    assert before and max(p["requests"] for p in before) >= 2 and max(p["answers"] for p in before) >= 1, prog
    figures = [(p["done"], p["requests"], p["answers"], p.get("rejected", 0)) for p in prog]
    assert all(map(lambda a, b: all(x <= y for x, y in zip(a, b)), figures, figures[1:])), figures
    assert prog[-1]["done"] == prog[-1]["total"] == 1, figures
    assert figures[-1] != figures[-2], figures  # the end line is not the last line again
    if os.environ.get("DFLASH_LONG") != "1":
        return
    # on a terminal the bar is redrawn with the decoded figures before it reaches 1/1
    rc, text = _prompts(tmp_path / "q.jsonl", tty=True)
    assert rc == 0, text[-3000:]
    assert "0/1" in text and "answers=1" in text and "1/1" in text, text[-2000:]
    assert text.index("answers=1") < text.index("1/1"), text[-2000:]
