"""`dflash-status --watch`: on a terminal it redraws in place (a pseudo-terminal here, so
the escape codes are real), piped with --json it prints one map per line, and a broker
that goes away is said so in place instead of ending the watch."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time

from tests.harness.spawn import default_sigint
from tests.harness.wait import wait_for
import pytest

pytestmark = pytest.mark.integration

CLEAR = b"\x1b[H\x1b[2J"


def _read_pty(fd: int, until, timeout_s: float) -> bytes:
    out, end = b"", time.monotonic() + timeout_s
    while time.monotonic() < end and not until(out):
        if select.select([fd], [], [], 0.1)[0]:
            try:
                out += os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
    return out


def test_watch_redraws_in_place_on_a_terminal_and_survives_the_broker_going(start_broker, fakes):
    b = start_broker()
    fakes("producer", b, "--instance", "tgt0", "--delay-s", "0.05")
    fakes("consumer", b, "--instance", "dft5")
    master, slave = pty.openpty()
    with default_sigint():  # the Ctrl-C below must reach a watcher that can take it
        p = subprocess.Popen([sys.executable, "-m", "dflash.tools.status_command", "--broker", b.control, "--watch", "0.3",
                              "--timeout-s", "0.5"], stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    try:
        out = _read_pty(master, lambda o: o.count(CLEAR) >= 4, 20)
        frames = out.split(CLEAR)[1:-1]  # complete frames: each is followed by the next clear
        assert len(frames) >= 3, out[-2000:]
        assert all(f"run {b.run_id}".encode() in f and b"every 0.3s; Ctrl-C to quit" in f for f in frames[:3])
        assert b.stop() == 0
        out = _read_pty(master, lambda o: b"no answer from" in o, 10)
        assert b"no answer from" in out and f"last run seen: {b.run_id}".encode() in out
        assert p.poll() is None  # still watching
        p.send_signal(signal.SIGINT)
        assert p.wait(10) == 0  # Ctrl-C ends it cleanly
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
        os.close(master)


def test_watch_json_prints_one_map_per_line(start_broker, fakes):
    b = start_broker()
    fakes("producer", b, "--instance", "tgt0", "--delay-s", "0.05")
    fakes("consumer", b, "--instance", "dft5")
    with default_sigint():
        p = subprocess.Popen([sys.executable, "-m", "dflash.tools.status_command", "--broker", b.control, "--watch", "0.2",
                              "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        wait_for(lambda: lines.append(p.stdout.readline()) or lines, lambda ls: len(ls) >= 3, 20, every_s=0)
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(10)
    maps = [json.loads(x) for x in lines[:3]]
    assert [m["run_id"] for m in maps] == [b.run_id] * 3
    assert maps[0]["broker"]["uptime_s"] < maps[2]["broker"]["uptime_s"]  # fresh each time
    assert all("diagnosis" in m and "\x1b" not in x for m, x in zip(maps, lines))
