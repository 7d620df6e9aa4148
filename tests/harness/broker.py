"""A real `dflash-broker` process on loopback ports chosen free, its stdout collected, and a
status probe."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import msgpack
import pytest
import zmq
from dflash.protocol.sockets import free_port_block



def ask_status(endpoint: str, timeout_s: float = 2.0) -> dict | None:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send(msgpack.packb({"v": 1, "type": "status"}))
        if s.poll(int(timeout_s * 1000)):
            return msgpack.unpackb(s.recv_multipart()[0])["status"]
        return None
    finally:
        s.close()


class BrokerProc:
    """A broker subprocess; `lines` collects its stdout (JSON log lines)."""

    def __init__(self, runs_dir: Path, args: list[str], n_out: int = 8, env: dict | None = None, preexec_fn=None):
        self.runs_dir = runs_dir
        self.port = free_port_block(2 + n_out)
        self.control = f"tcp://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dflash.broker.broker_command", "--bind", "127.0.0.1", "--port", str(self.port),
               "--data-in-port", str(self.port + 1), "--data-out-ports", f"{self.port + 2}-{self.port + 1 + n_out}",
               "--runs-dir", str(runs_dir), "--heartbeat-s", "0.2", "--timeout-s", "1.5", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})}, preexec_fn=preexec_fn)
        self.lines: list[str] = []
        self.stderr: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr), daemon=True).start()
        try:
            self.status = self._wait_up()
        except BaseException:  # nobody holds this broker yet: it would outlive the test
            self.proc.kill()
            self.proc.wait(10)
            raise
        self.run_id = self.status["run_id"]

    @staticmethod
    def _read(stream, out: list) -> None:
        for line in stream:
            out.append(line.rstrip("\n"))

    def _wait_up(self, timeout_s: float = 90.0) -> dict:
        # A deadline for a broker that never comes up, not a speed check: on a loaded
        # 2-core machine its imports alone can take tens of seconds.
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited {self.proc.returncode}: {self.stderr}")
            st = self.ask(0.5)
            if st is not None:
                return st
        raise RuntimeError(f"{type(self).__name__}: the broker did not answer status")

    def events(self, name: str | None = None) -> list[dict]:
        out = []
        for line in list(self.lines):
            ev = json.loads(line)
            if name is None or ev["event"] == name:
                out.append(ev)
        return out

    def wait_event(self, name: str, timeout_s: float = 10.0, pred=lambda ev: True) -> dict:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            for ev in self.events(name):
                if pred(ev):
                    return ev
            time.sleep(0.02)
        raise AssertionError(f"no {name} within {timeout_s}s; last lines: {self.lines[-5:]}")

    def ask(self, timeout_s: float = 2.0) -> dict | None:
        """The broker's status, or None when it does not answer within timeout_s."""
        return ask_status(self.control, timeout_s)

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.run_id


@contextmanager
def broker_procs(runs_dir: Path, make=BrokerProc) -> Iterator:
    """`start(*args, **kw)` -> make(runs_dir, list(args), **kw), a broker process; every one
    still running is killed on the way out. The body of each folder's broker fixture."""
    started: list[BrokerProc] = []

    def start(*args: str, **kw) -> BrokerProc:
        b = make(runs_dir, list(args), **kw)
        started.append(b)
        return b

    try:
        yield start
    finally:
        for b in started:
            if b.proc.poll() is None:
                b.proc.kill()
                b.proc.wait(5)


@pytest.fixture
def start_broker(tmp_path):
    """`start_broker(*args, n_out=8, env=None, preexec_fn=None)` starts a broker on free loopback ports under
    tmp_path/runs."""
    with broker_procs(tmp_path / "runs") as start:
        yield start
