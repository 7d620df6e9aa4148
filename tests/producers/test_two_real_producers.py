"""Two real producers on a small dataset both make batches (issue 36 item 3). A real
`dflash-produce` says hello only once its model is loaded, so the first to arrive leased all
50 samples (one producer's share is everything) and the second, started a second later,
made nothing. Now the second, asking with nothing while the pool is empty, gets the part of
the first one's lease that it has not started (`revoke` / `release`, PROTOCOL.md 4.3).

A real broker (default --lease-size), two real producers on a tiny target started a second
apart, and a fake committing consumer started once both said hello; `--queue-bytes 1` keeps
one batch queued at a time, and samples of ~1,500 tokens make batches too large for the
socket buffers to swallow the whole dataset: the first producer blocks with most of its
lease not started, however long the second takes to load its model (a tiny target makes
a batch in milliseconds; a real one is slow, which is what leaves its lease unstarted).
Every sample is committed exactly once."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time

import pytest

from tests.harness.ledger import committed
from tests.harness.spawn import COMMITTING, finish, spawn

pytestmark = pytest.mark.integration

N = 50


def test_a_producer_started_a_second_later_gets_part_of_the_first_ones_lease(brokers, tmp_path):
    from dflash.tools.tiny import tiny_target

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Tell story {i}."},
        {"role": "assistant", "content": f"Story {i}: " + "the quick brown fox jumps over the lazy dog. " * 50}]}) + "\n"
        for i in range(N)))
    b = brokers("--queue-bytes", "1", "--timeout-s", "60", "--heartbeat-s", "0.5")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}, "OMP_NUM_THREADS": "1"}
    target = str(tiny_target())

    def producer(name: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "dflash.producers.produce_command", "--broker", b.control,
                                 "--runs-dir", str(b.runs_dir), "--device", "cpu", "--target", target, "--data",
                                 str(data), "--max-length", "2048", "--max-batch-size", "1", "--instance", name],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    procs = [producer("first")]
    time.sleep(1.0)
    procs.append(producer("second"))
    cons = None
    try:
        # How long a model takes to load varies: the consumer starts once both said hello,
        # so the first one is not done before the second is up (it blocks on a full queue).
        b.wait_event("broker.peer_joined", 240, lambda e: e["peer_instance"] == "second")
        cons = spawn(COMMITTING, "consumer", b, "--instance", "c", "--train-s", "0.05", "--commit-every", "4")
        outs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
        assert finish([cons], 120) == [0]
        assert b.proc.wait(60) == 0
    finally:
        for p in procs + [cons]:
            if p is not None and p.poll() is None:
                p.kill()
    db = sqlite3.connect(f"file:{b.run_dir / 'ledger.sqlite'}?mode=ro", uri=True)
    made = dict(db.execute("SELECT p.instance, SUM(b.n_samples) FROM batches b JOIN peers p ON p.peer = b.producer "
                           "GROUP BY p.instance").fetchall())
    db.close()
    assert made.get("first", 0) > 0 and made.get("second", 0) > 0, (made, [(e["event"], e.get("peer"), e.get("n"), e.get("lease")) for e in b.events() if "lease" in e["event"] or "joined" in e["event"]])
    assert sum(made.values()) == N
    assert sorted(committed(b.run_dir)) == [(0, s) for s in range(N)]
    given = sum(e["n"] for e in b.events("broker.lease_split"))
    assert given > 0
    print(f"two real producers on {N} samples: {made}; {given} samples moved by splits")
