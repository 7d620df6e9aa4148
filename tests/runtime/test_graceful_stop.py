"""runtime/stop.py, the one SIGINT/SIGTERM handler of every role, with real signals in a
child process: the first signal asks for a stop, a second (or any before `armed`) kills
at once with that signal, and the broker's form only counts."""

from __future__ import annotations

import pytest
import signal
import subprocess
import sys
import textwrap

pytestmark = pytest.mark.integration

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from dflash.runtime.stop import GracefulStop
    seen = []
    stop = GracefulStop(armed={armed}, hard_second={hard}, on_signal=lambda s: seen.append(s.count)).install()
    print("ready", flush=True)
    for _ in range({n}):
        os.kill(os.getpid(), signal.{sig})
        time.sleep(0.05)
    stop.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    print(stop.is_set(), stop.signal_name, stop.count, seen, flush=True)
""")


def _run(armed: bool, hard: bool, n: int, sig: str = "SIGTERM") -> subprocess.CompletedProcess:
    code = CHILD.format(armed=armed, hard=hard, n=n, sig=sig)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_first_signal_asks_for_a_stop_and_is_recorded():
    r = _run(armed=True, hard=True, n=1, sig="SIGINT")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[1] == "True SIGINT 1 [1]"


def test_a_second_signal_kills_with_that_signal():
    r = _run(armed=True, hard=True, n=2)
    assert r.returncode == -signal.SIGTERM, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "ready\n"  # never reached the end


def test_a_signal_before_arming_kills_at_once():
    r = _run(armed=False, hard=True, n=1)
    assert r.returncode == -signal.SIGTERM, (r.returncode, r.stdout, r.stderr)


def test_the_brokers_form_only_counts():
    r = _run(armed=True, hard=False, n=3)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[1] == "True SIGTERM 3 [1, 2, 3]"
