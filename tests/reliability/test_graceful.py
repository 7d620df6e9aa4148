"""Graceful SIGINT/SIGTERM for every role (issue 7), on the real CPU pipeline of
test_chaos.py, then resumes to the end:

1. SIGINT to a producer: it says bye, the broker takes its leases back, it exits 0.
2. SIGTERM to the broker while consumers train: the broker drains: consumers finish the
   step, checkpoint and commit, and the broker records that commit before it exits 0.
3. (resumed) SIGTERM to one consumer of the elastic pair: it leaves the group and exits 0,
   the other trains on alone (issue 29: it used to stop both); then SIGTERM the broker:
   the one left finishes its step, checkpoints and commits it, and exits 0.
4. (resumed again) the run completes.

Nothing is trained twice: the chain's ledgers and the final checkpoint's record agree on
exactly once, and since every graceful stop committed everything it trained, no resumed
consumer ever met a sample its weights already held (no `train.skip_held`).
"""

from __future__ import annotations

import json
import signal
import time

import pytest
from tests.reliability.chaos_audit import audit, final_commit
from tests.reliability.chaos_pipeline import Pipeline

pytestmark = pytest.mark.integration

N_ROWS, EPOCHS = 400, 2  # long enough to stop it mid-training 3 times


def _events(pipe: Pipeline, run: str, file: str, name: str) -> list[dict]:
    path = pipe.runs / run / "logs" / f"{file}.jsonl"
    text = path.read_text() if path.exists() else ""
    lines = text.split("\n")[:-1]  # a live writer's last line may be half written: only whole lines
    return [e for e in map(json.loads, lines) if e["event"] == name]


def _wait(pred, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def _commits(pipe: Pipeline) -> int:
    return ((pipe.status() or {}).get("samples") or {}).get("committed") or 0


def _signal(pipe: Pipeline, name: str, sig: int, timeout_s: float = 60) -> int:
    pipe.procs[name].send_signal(sig)
    return pipe.procs[name].wait(timeout_s)


def _no_failures(pipe: Pipeline) -> None:
    """Every process of this generation leaves by itself, with 0, once the broker has."""
    assert pipe.wait_exit(list(pipe.procs), 60), f"still running: {[n for n in pipe.procs if pipe.alive(n)]}"
    codes = pipe.stop_rest()
    assert all(c == 0 for c in codes.values()), {n: pipe.tail(n) for n, c in codes.items() if c}


def _consumers_done(pipe: Pipeline, run: str, gen: int) -> dict[int, dict]:
    """rank -> its consume.done event."""
    out = {}
    for i in range(2):
        (start,) = _events(pipe, run, f"consumer-c{i}-g{gen}", "train.start")
        (done,) = _events(pipe, run, f"consumer-c{i}-g{gen}", "consume.done")
        out[start["rank"]] = done
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_graceful_stops_of_every_role_commit_what_they_trained_and_nothing_is_trained_twice(tmp_path):
    pipe = Pipeline(tmp_path, n_rows=N_ROWS, epochs=EPOCHS, seed=3)
    try:
        # -- generation 1: SIGINT a producer, then SIGTERM the broker while consumers train
        run1 = pipe.start_all(None, 1)
        _wait(lambda: _commits(pipe) > 0, 120, "a first commit")
        # (before its welcome a signal ends a producer at once: nothing is its to hand back)
        _wait(lambda: _events(pipe, run1, "producer-p0-g1", "produce.batch"), 60, "p0 producing")
        assert _signal(pipe, "p0-g1", signal.SIGINT) == 0, pipe.tail("p0-g1")
        (left,) = _wait(lambda: [e for e in _events(pipe, run1, "broker-main", "broker.peer_left")
                                 if e["peer_instance"] == "p0-g1"], 10, "the broker to log p0's bye")
        assert left["reason"] == "signal SIGINT"
        assert _events(pipe, run1, "producer-p0-g1", "produce.stopped")
        n = _commits(pipe)
        _wait(lambda: _commits(pipe) > n, 60, "training to go on with one producer")
        assert _signal(pipe, "broker", signal.SIGTERM) == 0, pipe.tail("broker")
        _no_failures(pipe)
        (stop,) = _events(pipe, run1, "broker-main", "broker.stop")
        assert stop["drain"] == "drained" and stop["outcome"] == "interrupted"
        done = _consumers_done(pipe, run1, 1)
        assert {d["reason"] for d in done.values()} == {"stop"} and done[0]["step"] == done[1]["step"]
        _, step, ckpt = final_commit(pipe.runs, [run1])
        assert step == done[0]["step"] and ckpt == done[0]["last_checkpoint"]  # recorded during the drain

        # -- generation 2 (resumed): SIGTERM one consumer (it leaves, the other goes on), then the broker
        run2 = pipe.start_all(run1, 2)
        (resumed,) = _events(pipe, run2, "broker-main", "broker.resume")
        assert resumed["checkpoint"]["step"] == step
        n = _commits(pipe)
        _wait(lambda: _commits(pipe) > n, 120, "a commit of the resumed run")
        assert _signal(pipe, "c1-g2", signal.SIGTERM) == 0, pipe.tail("c1-g2")
        (gone,) = _events(pipe, run2, "consumer-c1-g2", "consume.done")
        assert gone["reason"] == "left" and _events(pipe, run2, "consumer-c1-g2", "train.leaving")
        n = _commits(pipe)
        _wait(lambda: _commits(pipe) > n, 120, "c0 training on alone")
        assert pipe.alive("c0-g2")
        assert _signal(pipe, "broker", signal.SIGTERM) == 0, pipe.tail("broker")
        _no_failures(pipe)
        (done,) = _events(pipe, run2, "consumer-c0-g2", "consume.done")
        assert done["reason"] == "stop" and done["step"] > gone["step"]
        assert (final_commit(pipe.runs, [run2]) or (0, 0))[1] == done["step"]  # its last commit, recorded

        # -- generation 3 (resumed): to the end
        run3 = pipe.start_all(run2, 3)
        assert pipe.procs["broker"].wait(300) == 0, pipe.tail("broker")
        _no_failures(pipe)
        assert pipe.run_json(run3)["outcome"] == "completed"
    finally:
        pipe.close()

    a = audit(pipe.runs, pipe.chain, EPOCHS, N_ROWS)
    assert a.inherited_ok and not a.lost and not a.duplicated and not a.unexpected and a.record_complete
    for run, gen in ((run2, 2), (run3, 3)):
        for i in range(2):
            assert not _events(pipe, run, f"consumer-c{i}-g{gen}", "train.skip_held"), (run, i)
