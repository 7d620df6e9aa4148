"""End of stream (PROTOCOL.md 4.6) with real processes: 2 producers, 3 consumers, one
broker. Every batch reaches exactly one consumer, every consumer gets `stop`, every
process exits 0, and every log line of the run is JSON with the common fields."""

from __future__ import annotations

import json
import sqlite3

import pytest
from tests.harness.spawn import FAKES, spawn

pytestmark = pytest.mark.integration

N_SAMPLES = 60
COMMON = ("ts", "level", "event", "run_id", "role", "instance", "host", "pid")


@pytest.fixture(scope="module")
def eos_run(tmp_path_factory):
    from tests.harness.broker import BrokerProc

    tmp = tmp_path_factory.mktemp("eos")
    b = BrokerProc(tmp / "runs", ["--lease-size", "8"])
    procs = [spawn(FAKES, "consumer", b, "--instance", f"cons{i}", "--train-s", "0.005") for i in range(3)]
    results = []
    try:
        # Every consumer in before any data: on a loaded host a consumer that joins after the
        # last batch gets `stop` on arrival and is rightly not one the stream ended for.
        b.wait_event("broker.peer_joined", 60, lambda e: len(
            {x["peer_instance"] for x in b.events("broker.peer_joined") if x["peer_role"] == "consumer"}) == 3)
        # Both producers in before any data too: on a loaded host one that starts slowly would
        # find the run already ended by the other and its broker gone.
        go = tmp / "go"
        procs = [spawn(FAKES, "producer", b, "--n-samples", str(N_SAMPLES), "--instance", f"prod{i}",
                       "--go-file", str(go)) for i in range(2)] + procs
        b.wait_event("broker.peer_joined", 60, lambda e: len(
            {x["peer_instance"] for x in b.events("broker.peer_joined") if x["peer_role"] == "producer"}) == 2)
        go.touch()
        for p in procs:
            out, err = p.communicate(timeout=30)
            results.append((p.returncode, out, err))
        broker_rc = b.proc.wait(15)
    finally:
        for p in procs + [b.proc]:
            if p.poll() is None:
                p.kill()
    return b, results, broker_rc


def read_log(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_all_processes_exit_0(eos_run):
    b, results, broker_rc = eos_run
    assert [rc for rc, _, _ in results] == [0] * 5, [err[-400:] for _, _, err in results]
    assert broker_rc == 0, b.stderr
    info = json.loads((b.run_dir / "run.json").read_text())
    assert info["outcome"] == "completed" and info["ended_at"] and info["parent_run"] is None


def test_every_batch_delivered_exactly_once_and_every_sample_trained(eos_run):
    b, _, _ = eos_run
    logs = b.run_dir / "logs"
    sent = []
    for i in range(2):
        done = [e for e in read_log(logs / f"producer-prod{i}.jsonl") if e["event"] == "fake.producer_done"]
        sent.append(done[0]["batches"])
    acked = [e for i in range(3) for e in read_log(logs / f"consumer-cons{i}.jsonl") if e["event"] == "fake.acked"]
    ids = [e["batch_id"] for e in acked]
    assert len(ids) == len(set(ids)) == sum(sent)
    samples = sorted(s for e in acked for s in e["samples"])
    assert samples == list(range(N_SAMPLES))
    db = sqlite3.connect(b.run_dir / "ledger.sqlite")
    states = dict(db.execute("SELECT state, COUNT(*) FROM samples GROUP BY state").fetchall())
    assert states == {"committed": N_SAMPLES}


def test_every_consumer_got_stop(eos_run):
    b, _, _ = eos_run
    for i in range(3):
        done = [e for e in read_log(b.run_dir / "logs" / f"consumer-cons{i}.jsonl") if e["event"] == "fake.consumer_done"]
        assert done and done[0]["stop"] == "end_of_stream"
    eos = b.events("broker.end_of_stream")
    assert len(eos) == 1 and len(eos[0]["consumers"]) == 3
    left = {e["peer"] for e in b.events("broker.peer_left")}
    assert set(eos[0]["consumers"]) <= left


def test_every_log_line_is_json_with_common_fields(eos_run):
    b, results, _ = eos_run
    files = sorted((b.run_dir / "logs").glob("*.jsonl"))
    assert len(files) == 6  # broker + 2 producers + 3 consumers
    stdout = [(f"stdout[{i}]", line) for i, (_, out, _) in enumerate(results) for line in out.splitlines()]
    stdout += [("broker stdout", line) for line in b.lines]
    lines = [(f.name, line) for f in files for line in f.read_text().splitlines()] + stdout
    assert len(lines) > 50
    for where, line in lines:
        ev = json.loads(line)  # raises on a non-JSON line
        missing = [k for k in COMMON if k not in ev]
        assert not missing, f"{where}: {missing} missing in {line[:200]}"
        assert ev["run_id"] == b.run_id, f"{where}: {line[:200]}"
