"""Samples that wait to be remade with no producer are named (issue 36 item 2). A batch
that consumers fail on is quarantined and its samples go back to the pool to be made again;
if the only producer was already told `end` and left (or crashed), nobody makes them and
the run sits short of its total while the status blamed the consumer that failed. Now the
diagnosis says first: "start a producer: N samples wait to be remade". BrokerCore in-process."""

from __future__ import annotations

import pytest

from dflash.broker.diagnosis import diagnose
from tests.broker.test_quarantine import fail_on
from tests.harness.core_rig import Rig, sent

pytestmark = pytest.mark.unit


def test_status_says_start_a_producer_when_samples_wait_to_be_remade_and_none_is_connected(tmp_path):
    with Rig(tmp_path, num_samples=4, lease_size=8) as r:
        p, g = r.produce()
        bid = f"{p}-{g['lease']}-{g['samples'][0]}"
        assert sent(r.control(b"prod", "lease", want=8), "grant")[0].fields["end"] is True  # all made
        r.control(b"prod", "bye", reason="done")  # gone before the batch was found bad
        for c in (b"c1", b"c2"):
            r.consumer(c)
            r.dispatch()
            fail_on(r, c, bid)
        r.consumer(b"c3")
        d = diagnose(r.status())
        assert d["code"] == "remake_waits", d
        assert d["text"].startswith("start a producer: 4 samples wait to be remade") and d["limited_by"] == "targets"
        assert "dflash-produce --broker" in d["suggestion"]
