"""The broker raises its open-file limit (issue 36, finding 6): started with a soft
RLIMIT_NOFILE of 256 under a higher hard one, it logs `process.open_files` and runs with the
hard limit (/proc/<pid>/limits), so more half-open TCP connections than the old soft limit
(clients that never speak ZMTP, held by ZeroMQ until its handshake times out) do not stop it
from answering a real client's status."""

from __future__ import annotations

import resource
import socket

import pytest

pytestmark = pytest.mark.integration

SOFT = 256
HALF_OPEN = 400  # more than SOFT, far fewer than the hard limit


def _limits(pid: int) -> tuple[int, int]:
    for line in open(f"/proc/{pid}/limits"):
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no 'Max open files' line")


def test_the_broker_raises_a_low_soft_limit_and_outlasts_half_open_connections(start_broker):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < HALF_OPEN + 200:
        pytest.skip(f"the hard open-file limit here ({hard}) leaves no room above the soft one to test")
    mine, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if mine < HALF_OPEN + 100:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))  # this test's own sockets
    b = start_broker(preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, hard)))
    (ev,) = b.events("process.open_files")
    assert ev["role"] == "broker" and ev["soft_before"] == SOFT and ev["raised"] is True
    assert ev["soft"] == ev["hard"] == (hard if hard != resource.RLIM_INFINITY else "unlimited")
    assert _limits(b.proc.pid)[0] == ev["soft"]
    conns = []
    try:
        for i in range(HALF_OPEN):  # plain TCP, never a ZMTP greeting
            try:
                conns.append(socket.create_connection(("127.0.0.1", b.port), timeout=5))
            except OSError as e:  # the broker accepts nothing more: its listen backlog fills
                raise AssertionError(f"connection {i + 1} of {HALF_OPEN} to the broker failed: {e}") from None
        st = b.ask(timeout_s=10)
        assert st is not None, f"no status with {HALF_OPEN} half-open connections; stderr {b.stderr[-5:]}"
        assert b.proc.poll() is None
    finally:
        for c in conns:
            c.close()
