"""One run trains one model (issue 19, finding 1): with the broker's default `--consumers 0`
two consumers each trained a model of their own (world_size 1, rank 0) into the same run
folder while the ledger said everything was committed. The broker now refuses a second
drafter trainer unless it arranges the ranks (`--consumers N`) or the consumers say they
are ranks of one group they arranged themselves (hello config.group)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tests.harness.fakes import FakeConsumer, Rejected

pytestmark = pytest.mark.integration

SIGNAL = {"anchors": 8, "block_size": 4, "target_layers": None, "gamma": 1.0, "draft_layers": 1,
          "mask_token_id": 1, "target": "tiny"}


def test_a_second_consumer_of_a_run_without_ranks_is_refused_naming_the_option(brokers, tmp_path):
    from dflash.tools.tiny import tiny_target

    b = brokers("--timeout-s", "60")
    first = FakeConsumer(b.control, "first", config={"signal": SIGNAL})
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "dflash.consumers.process.consume_command", "--broker", b.control, "--target",
                           str(tiny_target()), "--runs-dir", str(b.runs_dir), "--draft-layers", "1",
                           "--block-size", "4", "--instance", "second"],
                          capture_output=True, text=True, env=env, timeout=120)
    first.pump()
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "--consumers" in last and "separate model" in last, last
    ev = b.wait_event("broker.peer_rejected", pred=lambda e: e["peer_instance"] == "second")
    assert ev["code"] == "full"
    assert [p["instance"] for p in (b.ask() or {})["peers"] if p["role"] == "consumer"] == ["first"]
    first.close()


def test_ranks_arranged_by_the_consumers_are_one_model(brokers):
    b = brokers()
    r0 = FakeConsumer(b.control, "r0", config={"signal": SIGNAL, "group": {"rank": 0, "world_size": 2}})
    r1 = FakeConsumer(b.control, "r1", config={"signal": SIGNAL, "group": {"rank": 1, "world_size": 2}})
    with pytest.raises(Rejected, match="full: .*--consumers"):
        FakeConsumer(b.control, "r0-again", config={"signal": SIGNAL, "group": {"rank": 0, "world_size": 2}})
    with pytest.raises(Rejected, match="full: .*separate model"):
        FakeConsumer(b.control, "alone", config={"signal": SIGNAL})
    # clients that train nothing (no signal) are not drafters: dispatch tests use several
    FakeConsumer(b.control, "reader").close()
    for c in (r0, r1):
        c.pump()
        c.close()
