"""Ctrl-C on one consumer of an elastic group takes that consumer out, not the job (issue
29, item 9): a real CPU pipeline (broker, 2 producers, 2 consumers of `--consumers 2`,
processes on loopback). SIGINT goes to the consumer holding broker rank 0 (the one that
checkpoints and commits) mid-run. It leaves between two steps without a checkpoint of its
own and exits 0; the broker records it as left (its batches back in the queue), not lost;
the other consumer goes on alone, takes over the commits, and the run completes with every
(epoch, sample) committed once and in the final weights once."""

from __future__ import annotations

import signal

import pytest
from tests.reliability.chaos_audit import audit
from tests.reliability.chaos_pipeline import Pipeline
from tests.reliability.test_elastic import _events, _start_group, _steps, _wait

pytestmark = pytest.mark.integration

N_ROWS, EPOCHS = 160, 1
SIGNAL_AT_STEP = 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_on_one_elastic_consumer_takes_it_out_and_the_other_goes_on(tmp_path):
    pipe = Pipeline(tmp_path, n_rows=N_ROWS, epochs=EPOCHS, seed=3, consumers=2)
    try:
        run, logs, log_of, rank = _start_group(pipe, 2, 180)
        names = list(log_of)
        leaver = next(n for n in names if rank[n] == 0)
        (stayer,) = [n for n in names if n != leaver]
        _wait(lambda: any(s >= SIGNAL_AT_STEP for s in _steps(_events(log_of[leaver]))), 240,
              f"{leaver} at step {SIGNAL_AT_STEP}", pipe)
        pipe.procs[leaver].send_signal(signal.SIGINT)  # Ctrl-C in its terminal
        assert pipe.wait_exit([leaver], 120), f"{leaver} did not leave: {pipe.tail(leaver)}"
        assert pipe.exited()[leaver] == 0, pipe.tail(leaver)
        assert "left the elastic group" in pipe.tail(leaver)

        _wait(lambda: "broker" in pipe.exited(), 400, "the run's end", pipe)
        assert pipe.exited()["broker"] == 0, pipe.tail("broker")
        assert pipe.wait_exit(list(pipe.procs), 60), f"peers still running after the broker ended: {pipe.exited()}"
        assert all(c == 0 for c in pipe.exited().values()), pipe.exited()
        assert pipe.run_json(run)["outcome"] == "completed"
    finally:
        pipe.close()

    ev = {n: _events(p) for n, p in log_of.items()}
    left = [e for e in ev[leaver] if e["event"] == "train.leaving"]
    assert len(left) == 1 and [e["reason"] for e in ev[leaver] if e["event"] == "train.end"] == ["left"]
    assert not [e for e in ev[leaver] if e["event"] == "train.checkpoint" and e["step"] > left[0]["step"]]
    assert not [e for e in ev[stayer] if e["event"] in ("train.stopping", "train.leaving")]
    broker = _events(logs / "broker-main.jsonl")
    assert [e["peer_instance"] for e in broker if e["event"] == "broker.peer_left"
            and e.get("peer_instance") in names][:1] == [leaver]
    assert not [e for e in broker if e["event"] in ("broker.peer_lost", "broker.job_lost")]
    # The stayer went on alone, past where the leaver left, with no step given back.
    steps = _steps(ev[stayer])
    assert steps == list(range(steps[0], steps[0] + len(steps))) and steps[-1] > left[0]["step"]
    assert any(e["event"] == "train.quorum" and e["world_size"] == 1 for e in ev[stayer])
    a = audit(pipe.runs, pipe.chain, EPOCHS, N_ROWS)
    assert not a.lost and not a.duplicated and not a.unexpected and a.record_complete, (
        sorted(a.lost)[:10], sorted(a.duplicated)[:10])
