"""Elastic consumers that wait, and a broker that dies (issue 19: finding 8, and "the
waiting consumer must not spin, torchft's output must not flood stdout"). Real processes on
loopback: a broker with --consumers 2 (elastic, its torchft lighthouse inside), a producer,
and consumers.

- A consumer alone in an elastic run of 2 holds a batch and waits for the other (the start
  waits for every rank): it must sleep, not spin through quorums, and neither it nor the
  broker (the lighthouse) may print a line per quorum.
- A broker SIGKILLed mid-run: every consumer and producer ends within --timeout-s (and a
  second or two) with `broker lost` as the last word on stderr and in its log.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from tests.reliability.chaos_pipeline import Pipeline

pytestmark = pytest.mark.integration

TIMEOUT_S = 3


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _events(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def _wait(pred, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def _lines(path: str) -> int:
    return len(Path(path).read_text(errors="replace").splitlines())


@pytest.mark.timeout(180)
def test_a_waiting_elastic_consumer_sleeps_torchft_stays_quiet_and_a_dead_broker_ends_it(tmp_path):
    pipe = Pipeline(tmp_path, n_rows=32, epochs=1, seed=1, timeout_s=TIMEOUT_S)
    try:
        pipe.start_broker(None)
        pipe.start_producer("p0")
        c = pipe.start_consumer("c0")
        log = pipe.runs / pipe.chain[-1] / "logs" / "consumer-c0.jsonl"
        # it has a batch and waits for the second rank of --consumers 2 (up to a minute)
        _wait(lambda: any(e["event"] == "train.quorum" for e in _events(log)), 90, "the consumer's first quorum")
        _wait(lambda: ((pipe.status() or {}).get("samples") or {}).get("delivered"), 30, "a batch delivered")
        time.sleep(1.0)
        broker_lines, consumer_lines = _lines(pipe.procs["broker"].log), _lines(c.log)
        cpu0, t0 = _cpu_s(c.pid), time.monotonic()
        time.sleep(4.0)
        share = (_cpu_s(c.pid) - cpu0) / (time.monotonic() - t0)
        broker_more, consumer_more = _lines(pipe.procs["broker"].log) - broker_lines, _lines(c.log) - consumer_lines
        assert c.poll() is None, pipe.tail("c0")
        assert not any(e["event"] == "train.step" for e in _events(log)), "it did not wait for the second rank"
        print(f"waiting consumer: {share:.2f} of a core; new output lines: broker {broker_more}, "
              f"consumer {consumer_more}")
        assert share < 0.25, f"the waiting consumer used {share:.2f} of a core"
        assert broker_more <= 5, pipe.tail("broker")
        assert consumer_more <= 5, pipe.tail("c0")

        # the broker dies while the consumer meets the (gone) lighthouse in a quorum
        pipe.kill("broker")
        t0 = time.monotonic()
        _wait(lambda: c.poll() is not None, 90, "the waiting consumer to exit")
        waited = time.monotonic() - t0
        print(f"waiting consumer exited {waited:.1f} s after the broker's death")
        assert c.returncode == 1 and waited <= TIMEOUT_S + 3, (c.returncode, waited, pipe.tail("c0"))
        assert "broker lost" in Path(c.log).read_text().strip().splitlines()[-1], pipe.tail("c0")
        assert _events(log)[-1]["event"] == "consume.broker_lost", _events(log)[-3:]
    finally:
        pipe.close()


@pytest.mark.timeout(240)
def test_a_dead_broker_ends_every_peer_within_the_timeout_saying_broker_lost(tmp_path):
    pipe = Pipeline(tmp_path, n_rows=200, epochs=2, seed=2, timeout_s=TIMEOUT_S)
    try:
        pipe.start_all(None, 1)
        _wait(lambda: ((pipe.status() or {}).get("samples") or {}).get("committed"), 120, "a first commit")
        _wait(lambda: len((pipe.status() or {}).get("peers", [])) == 4, 60, "every peer in the run")
        run_logs = pipe.runs / pipe.chain[-1] / "logs"
        peers = [n for n in pipe.procs if n != "broker"]
        assert all(pipe.alive(n) for n in peers), {n: pipe.tail(n) for n in peers}
        pipe.kill("broker")
        t0 = time.monotonic()
        ended: dict[str, float] = {}
        while len(ended) < len(peers) and time.monotonic() - t0 < 90:
            for n in peers:
                if n not in ended and not pipe.alive(n):
                    ended[n] = time.monotonic() - t0
            time.sleep(0.05)
        print(f"exits after the broker's death (timeout {TIMEOUT_S} s): "
              + ", ".join(f"{n} {s:.1f} s" for n, s in sorted(ended.items())))
        assert set(ended) == set(peers), f"still running 90 s after the broker died: {set(peers) - set(ended)}"
        for n in peers:
            p = pipe.procs[n]
            assert p.returncode == 1, (n, p.returncode, pipe.tail(n))
            assert ended[n] <= TIMEOUT_S + 3, (n, ended[n], pipe.tail(n))
            last = Path(p.log).read_text(errors="replace").strip().splitlines()[-1]
            assert "broker lost" in last, (n, last)
            role = "consumer" if n.startswith("c") else "producer"
            ev = _events(run_logs / f"{role}-{n}.jsonl")
            assert ev[-1]["event"].endswith(".broker_lost"), (n, ev[-3:])
    finally:
        pipe.close()
