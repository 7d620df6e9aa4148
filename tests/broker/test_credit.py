"""A real consumer's credit (ConsumerLink + protocol/credit.py) against a real broker: small
batches get a deeper inbox, large ones keep two, and the bound holds at the broker."""

from __future__ import annotations

import json
import subprocess
import threading

import pytest

from tests.harness.fakes import FakeProducer
from tests.harness.spawn import child_env, module_argv

pytestmark = pytest.mark.integration

N = 40


@pytest.mark.parametrize("width,inbox_bytes,depth", [(8, 1 << 20, 16), (16384, 200_000, 2)])
def test_inbox_depth_follows_batch_size_and_is_never_exceeded(start_broker, tmp_path, width, inbox_bytes, depth):
    """A consumer that takes nothing: the broker sends it exactly its window and keeps the
    rest queued. Tiny batches: 16 (the cap). 128 KiB batches with a 200 kB budget: the
    floor, 2. Then it takes and acks every batch: each arrives exactly once."""
    b = start_broker("--num-samples", str(N), "--lease-size", "8", "--queue-bytes", "1GiB")
    with open(tmp_path / "hold.stderr", "w") as err:
        cons = subprocess.Popen(module_argv("tests.broker.link_peers", "hold", b.control, str(b.runs_dir), str(N),
                                            str(inbox_bytes)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True, env=child_env())
    prod = FakeProducer(b.control, "credit-prod", n_samples=N, per_batch=1, width=width)
    t = threading.Thread(target=prod.run_to_end, daemon=True)
    t.start()
    try:
        held = json.loads(cons.stdout.readline() or "{}")
        st = b.ask()
        c = next(p for p in st["peers"] if p["role"] == "consumer")
        assert held.get("held") == depth, (tmp_path / "hold.stderr").read_text()[-2000:]
        assert held["io_threads"] == [1, 2]  # control on the link's first I/O thread, batches on the second
        assert (c["in_flight"], c["credit"]) == (depth, 0)
        assert st["queue"]["batches"] == N - depth  # everything else waits at the broker
        cons.stdin.write("go\n")
        cons.stdin.flush()
        out = json.loads(cons.stdout.readline() or "{}")
        assert out == {"samples": list(range(N))}
        assert cons.wait(20) == 0
        t.join(20)
    finally:
        if cons.poll() is None:
            cons.kill()
