"""A consumer that runs out of memory splits its steps into micro-batches and the run goes
on (issue 7): the real CPU pipeline of test_chaos.py (broker, producer, consumer as
processes on loopback), the consumer's OOMs injected in its real training loop with
DFLASH_TEST_OOM_TOKENS (consumers/training/step_oom.py). The run completes, every (epoch, sample) is
trained exactly once and committed, and the consumer's log says what happened.
"""

from __future__ import annotations

import json

import pytest
from tests.reliability.chaos_audit import audit
from tests.reliability.chaos_pipeline import Pipeline

pytestmark = pytest.mark.integration

N_ROWS, EPOCHS = 40, 2
OOM_ABOVE = 150  # tokens: the chats are 49..148 tokens, so any one fits alone and most pairs do not


def _events(pipe: Pipeline, run: str, file: str) -> list[dict]:
    return [json.loads(line) for line in (pipe.runs / run / "logs" / f"{file}.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_a_consumer_out_of_memory_splits_its_steps_and_trains_every_sample_once(tmp_path):
    pipe = Pipeline(tmp_path, n_rows=N_ROWS, epochs=EPOCHS, seed=5, consumers=1)
    try:
        run = pipe.start_broker(None)
        # Batches of up to 4 chats, so a step splits into 2 and then 4 micro-batches.
        pipe._spawn("p0", "dflash.producers.produce_command", [
            "--broker", pipe.control, "--runs-dir", str(pipe.runs), "--instance", "p0", "--device", "cpu",
            "--target", pipe.target, "--data", str(pipe.data), "--token-budget", "640", "--max-length", "512",
            "--max-batch-size", "4", "--lease-size", "8", "--prefetch", "2"])
        pipe.env["DFLASH_TEST_OOM_TOKENS"] = str(OOM_ABOVE)  # the consumer's environment only
        pipe.start_consumer("c0")
        del pipe.env["DFLASH_TEST_OOM_TOKENS"]
        assert pipe.wait_exit(list(pipe.procs), 240), {n: pipe.tail(n) for n in pipe.procs if pipe.alive(n)}
        codes = pipe.exited()
        assert codes == {"broker": 0, "p0": 0, "c0": 0}, {n: pipe.tail(n) for n, c in codes.items() if c}
    finally:
        pipe.close()

    ev = _events(pipe, run, "consumer-c0")
    names = [e["event"] for e in ev]
    assert "train.oom_injection" in names and "train.oom" not in names and "consume.failed" not in names
    splits = [e for e in ev if e["event"] == "train.oom_split"]
    assert splits and {e["failed_splits"] for e in splits} <= {1, 2} and {e["splits"] for e in splits} <= {2, 4}
    assert all(e["part_tokens"] > OOM_ABOVE and e["device"] == "cpu" for e in splits)
    steps = [e for e in ev if e["event"] == "train.step"]
    assert max(e["micro_batches"] for e in steps) > 1 and steps[-1]["ooms"] == len(splits)
    (done,) = [e for e in ev if e["event"] == "consume.done"]
    assert done["reason"] == "end_of_stream" and done["samples"] == N_ROWS * EPOCHS

    a = audit(pipe.runs, pipe.chain, EPOCHS, N_ROWS)
    print(f"oom splits {len(splits)}, steps {len(steps)}, samples lost {len(a.lost)}, "
          f"duplicated {len(a.duplicated)}")
    assert not a.lost and not a.duplicated and not a.unexpected and a.record_complete
