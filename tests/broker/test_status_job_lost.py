"""dflash-status of a run whose training job is lost (issue 20: it said `LIVE (running)`,
an ETA and "restart it", while a restarted consumer is refused). Real broker, fake peers:
the job dies with trained samples not committed; the status map, its diagnosis and
dflash-status's text say the job is lost and that only a resume goes on."""

from __future__ import annotations

import subprocess
import sys

from tests.harness.fakes import FakeConsumer, FakeProducer
from tests.broker.test_job_lost import _one_batch_each

from dflash.tools.status_view import header
import pytest

pytestmark = pytest.mark.integration


def test_a_lost_job_is_not_running_has_no_eta_and_says_resume(start_broker):
    b = start_broker("--lease-size", "2", "--consumers", "2")
    prod = FakeProducer(b.control, "p", n_samples=4, per_batch=1)
    r0 = FakeConsumer(b.control, "r0", config={"dist_addr": "127.0.0.1:29500"})
    r1 = FakeConsumer(b.control, "r1")
    a, c = _one_batch_each(b, prod, [r0, r1])
    r0.send("ack", batch_ids=[a], step=1)
    r1.send("ack", batch_ids=[c], step=1)
    r1.send("bye", reason="failed")
    r0.send("bye", reason="failed")
    b.wait_event("broker.job_lost", 5)
    st = b.ask()
    assert st["broker"]["state"] == "job_lost" and st["job_lost"]["trained"] == 2
    assert st["progress"]["eta_s"] is None
    d = st["diagnosis"]
    assert d["code"] == "job_lost" and "restart it" not in (d["suggestion"] or "")
    assert f"dflash-broker --resume {b.run_id}" in d["suggestion"] and "refused" in d["suggestion"]
    text = "\n".join(header(st))
    assert "LIVE (running)" not in text and "JOB LOST" in text and "ETA -" in text, text
    r = subprocess.run([sys.executable, "-m", "dflash.tools.status_command", "--broker", b.control], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0 and "JOB LOST" in r.stdout and "--resume" in r.stdout, r.stdout + r.stderr
    for p in (prod, r0, r1):
        p.close()
