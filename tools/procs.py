"""A small process group for local runs: start role processes, watch them, stop them all.

Used by `dflash-demo` and the tests that run the whole pipeline. Every child runs in its
own process group so that one Ctrl-C in the terminal reaches the demo only, and the demo
decides the order of shutdown (SIGTERM to all, then SIGKILL to stragglers).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    out_path: Path

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class ProcessGroup:
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: list[str], out_path: Path, env: dict | None = None) -> Child:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with open(out_path, "wb") as out:  # a new file per run: never appended to by two runs
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        child = Child(name, proc, out_path)
        self.children.append(child)
        return child

    def failed(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() not in (None, 0)]

    def all_exited(self) -> bool:
        return all(not c.alive() for c in self.children)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM every live child, wait up to `grace_s`, then SIGKILL what is left."""
        for c in self.children:
            if c.alive():
                _signal(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(c.proc, signal.SIGKILL)
                c.proc.wait(timeout=5)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def tail_lines(path: Path, offset: int) -> tuple[list[str], int]:
    """Complete lines appended to `path` since `offset`, and the new offset."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [], offset
    if size <= offset:
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read(size - offset)
    end = chunk.rfind(b"\n") + 1
    return chunk[:end].decode(errors="replace").splitlines(), offset + end
