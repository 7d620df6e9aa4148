"""`dflash-broker --time-budget` with real processes on loopback: the broker, a CPU producer
running a tiny real target over the bundled chats, a CPU consumer training a drafter. The
dataset's epochs are far more than the budget can train, so the budget alone ends the run:
it ends near the deadline, the consumer's last step is trained at --min-lr (annealed), and
every sample trained is committed exactly once in the ledger.

The tolerance: the broker plans so that the last planned sample is trained `reserve_s`
before the deadline; the plan is re-made every `every_s` and at once if it is trained early,
so the end of stream comes no earlier than one re-plan period before that; after it the
consumer's final checkpoint, commit and exit fit in the reserve. Late by more than the
reserve would mean a plan the pace did not hold: the test allows the reserve again on top
(a 2-core machine shared with other test processes slows a step unevenly).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest

from dflash.broker.budget import every_for, reserve_for
from dflash.protocol.sockets import free_port_block

pytestmark = pytest.mark.integration

BUDGET_S = 45.0
N_ROWS = 40
EPOCHS = 500  # 20,000 samples: far more than the budget trains on 2 cores
MIN_LR = 1e-5


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _ts(e: dict) -> float:
    return datetime.fromisoformat(e["ts"].replace("Z", "+00:00")).timestamp()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from dflash.tools.tiny import tiny_target

    import dflash.producers.sample_data as sample_data

    tmp = tmp_path_factory.mktemp("budget")
    chats = (Path(sample_data.__file__).parent / "chats.jsonl").read_text().splitlines()[:N_ROWS]
    data = tmp / "chats.jsonl"
    data.write_text("\n".join(chats) + "\n")
    target, runs = str(tiny_target()), str(tmp / "runs")
    base = free_port_block(5)
    broker = f"tcp://127.0.0.1:{base}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(OMP_NUM_THREADS="1", DFLASH_LOG_JSON="1")
    args = {
        "broker": ["dflash.broker.broker_command", "--bind", "127.0.0.1", "--port", str(base),
                   "--data-in-port", str(base + 1), "--data-out-ports", f"{base + 2}-{base + 4}", "--runs-dir", runs,
                   "--epochs", str(EPOCHS), "--time-budget", f"{BUDGET_S:g}s", "--heartbeat-s", "0.5",
                   "--timeout-s", "30", "--lease-size", "8"],
        "producer": ["dflash.producers.produce_command", "--broker", broker, "--runs-dir", runs, "--instance", "p0",
                     "--device", "cpu", "--target", target, "--data", str(data), "--token-budget", "256",
                     "--max-length", "256", "--max-batch-size", "2", "--lease-size", "8", "--prefetch", "2"],
        "consumer": ["dflash.consumers.process.consume_command", "--broker", broker, "--runs-dir", runs, "--instance", "c0",
                     "--target", target, "--block-size", "4", "--anchors", "16", "--draft-layers", "1",
                     "--lr", "3e-3", "--min-lr", str(MIN_LR), "--save-every", "50", "--keep", "2",
                     "--log-position-every", "0"],
    }
    procs = {}
    for name, a in args.items():
        with open(tmp / f"{name}.out", "w") as f:
            procs[name] = subprocess.Popen([sys.executable, "-m", *a], stdout=f, stderr=subprocess.STDOUT, env=env)
        if name == "broker":
            time.sleep(0.5)
    deadline = time.monotonic() + BUDGET_S + 90
    try:
        for p in procs.values():
            p.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = {name: p.returncode for name, p in procs.items()}
    if any(codes.values()):
        pytest.fail(f"exit codes {codes}: " + str({n: (tmp / f"{n}.out").read_text()[-1500:] for n in codes}))
    (run_dir,) = [p for p in Path(runs).iterdir() if p.name != "latest"]
    return run_dir


def test_the_run_ends_near_the_deadline_by_the_plan(run):
    broker = _events(run / "logs" / "broker-main.jsonl")
    plans = [e for e in broker if e["event"] == "broker.plan"]
    assert plans and all(e["budget_s"] == BUDGET_S for e in plans)
    assert plans[-1]["planned_samples"] < plans[-1]["samples_total"]  # the budget ended it, not the epochs
    start = _ts(broker[0])  # the broker's first line: the budget counts from about then
    eos = next(e for e in broker if e["event"] == "broker.end_of_stream")
    stop = next(e for e in broker if e["event"] == "broker.stop")
    assert stop["reason"] == "end_of_stream" and stop["outcome"] == "completed"
    reserve, every = reserve_for(BUDGET_S), every_for(BUDGET_S)
    ended = _ts(stop) - start
    print(f"budget {BUDGET_S}s: end of stream at {_ts(eos) - start:.1f}s, broker stop at {ended:.1f}s, "
          f"plans {[(p['elapsed_s'], p['planned_samples'], p['rate']) for p in plans]}")
    assert BUDGET_S - reserve - every <= _ts(eos) - start and ended <= BUDGET_S + reserve


def test_the_last_step_is_annealed_to_min_lr(run):
    consumer = _events(run / "logs" / "consumer-c0.jsonl")
    steps = [e for e in consumer if e["event"] == "train.step"]
    end = next(e for e in consumer if e["event"] == "train.end")
    # The schedule follows the broker's clock (budget_progress): its progress on the last step
    # is the last plan's share trained before that step's own batch, so within a batch of 1.
    assert end["reason"] == "end_of_stream" and end["progress"] >= 0.95, end
    lr_max = max(e["lr"] for e in steps)
    assert end["lr"] <= MIN_LR + 0.01 * (lr_max - MIN_LR) and steps[-1]["lr"] == end["lr"]
    assert not [e for e in consumer if e["event"] == "train.unannealed"]
    # its lr never jumped: falling from the peak on
    lrs = [e["lr"] for e in steps]
    peak = lrs.index(max(lrs))
    assert all(b <= a * (1 + 1e-9) for a, b in zip(lrs[peak:], lrs[peak + 1:]))
    schedules = [e for e in consumer if e["event"] == "train.schedule"]
    assert schedules[-1]["by"] == "time" and schedules[-1]["source"] == "--time-budget"
    # and it was not over long before the end (the first plans were made from a slower pace)
    late = [e for e in steps if e["lr"] > MIN_LR + 0.05 * (lr_max - MIN_LR)]
    assert late and _ts(late[-1]) - _ts(steps[0]) > 0.6 * (_ts(steps[-1]) - _ts(steps[0]))


def test_every_sample_trained_is_committed_exactly_once(run):
    db = sqlite3.connect(f"file:{run / 'ledger.sqlite'}?mode=ro", uri=True)
    rows = db.execute("SELECT epoch, sample, state, batch_id FROM samples").fetchall()
    batches = {b: (n, d, state) for b, n, d, state in
               db.execute("SELECT batch_id, n_samples, deliveries, state FROM batches")}
    db.close()
    assert rows and {state for *_, state, _ in rows} == {"committed"}  # nothing leased past the plan
    assert len({(e, s) for e, s, _, _ in rows}) == len(rows)
    per_batch = Counter(b for *_, b in rows)
    assert all(batches[b] == (n, 1, "committed") for b, n in per_batch.items())  # delivered once, trained once
    consumer = _events(run / "logs" / "consumer-c0.jsonl")
    done = next(e for e in consumer if e["event"] == "consume.done")
    plans = [e for e in _events(run / "logs" / "broker-main.jsonl") if e["event"] == "broker.plan"]
    assert done["samples"] == len(rows) == plans[-1]["planned_samples"]
