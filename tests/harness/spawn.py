"""Test processes: the wire fakes (tests.harness.fakes and the fakes built on it) and the
folder's scripts run as modules of the tests package, waited for, their memory read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]  # the repository: where the `tests` package lies

FAKES = "tests.harness.fakes"  # hand-written producer and consumer (PROTOCOL.md)
COMMITTING = "tests.harness.committing_fakes"  # consumers that commit, peers over CurveZMQ
STATS = "tests.harness.stats_fakes"  # peers whose heartbeats carry GPU and step stats


def child_env(env: dict | None = None) -> dict:
    """The environment of a child that runs a module of the tests package: the repository
    on its PYTHONPATH (the package is not installed)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def module_argv(module: str, *args: str) -> list[str]:
    """argv of `python -m module args`, for a module of the tests package."""
    return [sys.executable, "-m", module, *args]


@contextmanager
def default_sigint() -> Iterator[None]:
    """Children started inside get SIGINT at its default, as from an interactive shell, so
    that Python turns it into KeyboardInterrupt. A runner started as a background job of a
    shell without job control ignores SIGINT; exec keeps an ignored signal ignored (and
    Python then installs no handler) but resets a caught one. Main thread only."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, lambda *_: None)  # caught: not inherited, still a no-op here
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def spawn(fakes: str, role: str, broker, *args: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    """A fake peer process of module `fakes` (FAKES, COMMITTING, STATS) attached to `broker`."""
    return subprocess.Popen(module_argv(fakes, role, "--broker", broker.control, "--runs-dir", str(broker.runs_dir),
                                        *args), stdout=stdout, stderr=subprocess.PIPE, text=True, env=child_env())


def finish(procs: list[subprocess.Popen], timeout_s: float = 60.0) -> list[int]:
    """Wait for every process (killing stragglers at the deadline); their exit codes."""
    end = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        p.output = (out or "") + (err or "")  # for assertion messages
        codes.append(p.returncode)
    return codes


def killed_part_way(brokers, n_samples: int, *broker_args: str, commits: int = 8):
    """A run whose broker is SIGKILLed once `commits` samples are committed (a committing
    consumer and a producer of `n_samples`, both slowed): (its broker, the samples it
    committed), the start of a resume test."""
    from tests.harness.ledger import committed
    from tests.harness.wait import wait_until

    b = brokers("--lease-size", "4", *broker_args)
    peers = [spawn(COMMITTING, "consumer", b, "--instance", "c", "--train-s", "0.05", "--commit-every", "2"),
             spawn(COMMITTING, "producer", b, "--instance", "p", "--n-samples", str(n_samples), "--delay-s", "0.05")]
    wait_until(lambda: (b.ask() or {}).get("samples", {}).get("committed", 0) >= commits, 60,
               f"{commits} committed samples")
    b.proc.kill()
    b.proc.wait(5)
    finish(peers, 20)
    return b, set(committed(b.run_dir))


def rss_kib(pid: int) -> int:
    """VmRSS of a live process, KiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")
