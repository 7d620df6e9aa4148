"""`end` is not final while samples may still need making (issue 36 item 2). A batch that
consumers fail on is quarantined and its samples go back to the pool to be made again; if
the only producer was already told `end` and left, nobody makes them and the run sits short
of its total. So a producer is granted `end` only once every sample is made AND no batch is
queued or in flight (until then: "ask again"); and if samples wait to be remade with no
producer connected (one crashed), the status says so first: "start a producer: N samples
wait to be remade". BrokerCore in-process."""

from __future__ import annotations

import pytest

from dflash.broker.diagnosis import diagnose
from dflash.broker.phase import Phase
from tests.broker.test_quarantine import fail_on
from tests.harness.core_rig import Rig, ledger_states, sent

pytestmark = pytest.mark.unit


def grant(r: Rig, identity: bytes, want: int = 8) -> dict:
    return sent(r.control(identity, "lease", want=want), "grant")[0].fields


def test_a_producer_is_not_told_end_while_a_batch_may_still_be_quarantined(tmp_path):
    with Rig(tmp_path, num_samples=4, lease_size=8) as r:
        p, g = r.produce()  # every sample made, one batch queued
        bid = f"{p}-{g['lease']}-{g['samples'][0]}"
        again = grant(r, b"prod")
        assert (again["samples"], again["end"], again["retry_ms"]) == ([], False, 500)  # not end: stay
        for c in (b"c1", b"c2"):  # both consumers fail on it (--quarantine-after 2): its samples are remade
            r.consumer(c)
            r.dispatch()
            fail_on(r, c, bid)
        assert r.core.work.pool.pending() == 4
        remade = grant(r, b"prod")  # the producer is still there to make them
        assert sorted(remade["samples"]) == sorted(g["samples"])
        r.batch(p, remade["lease"], remade["epoch"], remade["samples"], batch_id="good")
        r.consumer(b"c3")
        r.dispatch()
        assert grant(r, b"prod")["end"] is False  # in flight still
        r.control(b"c3", "ack", batch_ids=["good"], step=1)
        r.control(b"c3", "commit", step=1, checkpoint="ckpt/1")
        assert grant(r, b"prod")["end"] is True  # made and trained: nothing can come back now
        r.tick(r.advance(5))
        assert r.core.life.phase is Phase.ENDING and ledger_states(r.core) == {"committed": 4}


def test_status_says_start_a_producer_when_samples_wait_to_be_remade_and_none_is_connected(tmp_path):
    with Rig(tmp_path, num_samples=4, lease_size=8) as r:
        p, g = r.produce()
        bid = f"{p}-{g['lease']}-{g['samples'][0]}"
        r.control(b"prod", "bye", reason="crashed")  # gone before the batch was found bad
        for c in (b"c1", b"c2"):
            r.consumer(c)
            r.dispatch()
            fail_on(r, c, bid)
        r.consumer(b"c3")
        d = diagnose(r.status())
        assert d["code"] == "remake_waits", d
        assert d["text"].startswith("start a producer: 4 samples wait to be remade") and d["limited_by"] == "targets"
        assert "dflash-produce --broker" in d["suggestion"]
