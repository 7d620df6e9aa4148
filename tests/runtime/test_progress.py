"""runtime/progress.py: a bar on a terminal (a real pseudo-terminal), log lines with the
figures in a pipe, and a log line no more often than asked (an injected clock)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dflash.runtime.progress import Progress, progress_mode
from tests.harness.terminal import on_a_terminal

pytestmark = pytest.mark.unit

SCRIPT = """
from dflash.runtime.logs import setup_logging
from dflash.runtime.progress import progress
setup_logging("tool", "t")
with progress("things", total=40, unit="thing") as bar:
    for i in range(40):
        bar.update()
        bar.note(kept=i)
"""


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(DFLASH_LOG_JSON="1", **kw)
    return env


def test_a_bar_on_a_terminal_and_log_lines_in_a_pipe():
    # A pipe: no bar characters on stderr, one progress line (the final one) on stdout.
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=_env(), timeout=60)
    assert res.returncode == 0, res.stderr
    assert "it/s" not in res.stderr and "thing/s" not in res.stderr and "|" not in res.stderr
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    prog = [x for x in lines if x["event"] == "progress.update"]
    assert prog and prog[-1]["done"] == 40 and prog[-1]["total"] == 40 and prog[-1]["kept"] == 39
    # A terminal: stderr is a pseudo-terminal, and tqdm draws its bar there.
    rc, text, stdout = on_a_terminal([sys.executable, "-c", SCRIPT], _env(), 60)
    assert rc == 0
    assert "things" in text and "40/40" in text and "kept=39" in text
    assert not any(json.loads(x)["event"] == "progress" for x in stdout.splitlines() if x.startswith("{"))


def test_log_lines_come_at_most_every_interval():
    now = [0.0]
    lines = []
    bar = Progress("x", 100, "it", mode="log", every_s=10.0, clock=lambda: now[0])
    bar._log = lambda: lines.append(now[0]) or setattr(bar, "_last", now[0])
    for _ in range(100):
        now[0] += 1.0
        bar.update()
    assert lines == [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0]


def test_the_mode_follows_the_stream_and_can_be_forced(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    monkeypatch.delenv("DFLASH_PROGRESS", raising=False)
    assert progress_mode(Tty()) == "bar"
    assert progress_mode(open(os.devnull, "w")) == "log"
    monkeypatch.setenv("DFLASH_PROGRESS", "off")
    assert progress_mode(Tty()) == "off"
