"""What the broker logs for a producer without CurveZMQ against a Curve broker is what
docs/LOGS.md says it logs (issue 36, finding 7): the doc promised `mechanism_mismatch`, and
a client that sends its hello at once, as every peer does, gets `no_detail`. A real Curve
broker and a plain ZeroMQ client sending a hello, once (no reconnect within the test)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import zmq

from tests.harness.broker import broker_procs
from tests.harness.curve import CurveBrokerProc

pytestmark = pytest.mark.integration

DOCS = Path(__file__).resolve().parents[2] / "docs" / "LOGS.md"


def test_a_plain_peer_against_a_curve_broker_logs_what_logs_md_says(tmp_path):
    keys = tmp_path / "keys"
    for name in ("broker", "probe"):
        subprocess.run([sys.executable, "-m", "dflash.tools.keys", str(keys), "--name", name], check=True,
                       capture_output=True, timeout=60)
    with broker_procs(tmp_path / "runs", lambda runs, args: CurveBrokerProc(runs, args, keys, "probe")) as start:
        b = start()
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, 60_000)  # one attempt
        s.connect(b.control)
        s.send(msgpack.packb({"v": 1, "type": "hello", "role": "producer", "instance": "plain", "host": "x", "pid": 1}))
        ev = b.wait_event("broker.handshake_failed", 20, lambda e: e["socket"] == "control")
        s.close()
    assert ev["curve"] is True and "--curve-keys" in ev["hint"]
    row = next(line for line in DOCS.read_text().splitlines() if line.startswith("| `broker.handshake_failed`"))
    said = re.search(r"`(\w+)` when the client saw the other mechanism first and hung up, which is what a producer "
                     r"or consumer without `--curve-keys` gives", row)
    assert said is not None, row
    assert ev["error"] in (said.group(1), "mechanism_mismatch") and f"`{ev['error']}`" in row, (ev, row)
