"""The broker with the project's own client (protocol.peer.PeerLink) on both sides, as
processes: tensors go through intact and the run ends cleanly."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

from broker_harness import HERE

N_SAMPLES = 24


def test_peerlink_producer_and_consumer_run_to_end_of_stream(start_broker):
    b = start_broker("--lease-size", "8")
    script = str(HERE / "link_peers.py")
    procs = [subprocess.Popen([sys.executable, script, "producer", b.control, str(b.runs_dir), str(N_SAMPLES)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
             subprocess.Popen([sys.executable, script, "consumer", b.control, str(b.runs_dir)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err[-800:] for _, err in outs]
    assert b.proc.wait(15) == 0
    result = json.loads([line for line in outs[1][0].splitlines() if '"all_ok"' in line][-1])
    assert result == {"samples": list(range(N_SAMPLES)), "all_ok": True}
    db = sqlite3.connect(b.run_dir / "ledger.sqlite")
    assert db.execute("SELECT COUNT(*) FROM samples WHERE state='committed'").fetchone()[0] == N_SAMPLES
    logs = sorted(p.name for p in (b.run_dir / "logs").glob("*.jsonl"))
    assert logs == ["broker-main.jsonl", "consumer-link-cons.jsonl", "producer-link-prod.jsonl"]
