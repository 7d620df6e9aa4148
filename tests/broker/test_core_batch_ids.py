"""A batch ID names one batch for the whole run (issue 36 item 4, PROTOCOL.md 4.4): once a
batch was accepted its ID is the key of its ledger row, whatever became of it (queued,
delivered, trained, committed, quarantined; one still queued or in flight is dropped as
stale, as before). Another batch under that ID, even from another
producer on its own lease, would replace that row; it is refused (fault `batch_id_reused`),
counted with the run's bad batches, and the first batch's row is kept. BrokerCore in-process."""

from __future__ import annotations

import sqlite3

import pytest

from tests.harness.core_rig import Rig, sent

pytestmark = pytest.mark.unit


def rows(core) -> dict[str, tuple]:
    core.ledger.flush()
    core.ledger.sync()
    db = sqlite3.connect(core.ledger.path)
    try:
        return {r[0]: r[1:] for r in db.execute("SELECT batch_id, producer, state, n_samples FROM batches")}
    finally:
        db.close()


@pytest.mark.parametrize("then", ["trained", "committed"])
def test_a_batch_id_accepted_before_is_refused_and_its_ledger_row_kept(tmp_path, then):
    with Rig(tmp_path, lease_size=2) as r:
        r.hello(b"pa", "producer")
        r.hello(b"pb", "producer")
        ga = sent(r.control(b"pa", "lease", want=2), "grant")[0].fields
        gb = sent(r.control(b"pb", "lease", want=2), "grant")[0].fields
        a, b = r.peer(b"pa").id, r.peer(b"pb").id
        r.batch(a, ga["lease"], ga["epoch"], ga["samples"], batch_id="x-1")
        r.consumer(b"c", credit=1)
        r.dispatch()
        r.control(b"c", "ack", batch_ids=["x-1"], step=1)
        if then == "committed":
            r.control(b"c", "commit", step=1, checkpoint="/ckpt/1")
        r.batch(b, gb["lease"], gb["epoch"], gb["samples"], batch_id="x-1")  # another producer, its own lease
        assert rows(r.core)["x-1"] == (a, then, 2)
        st = r.status()
        assert st["bad_batches"] == {"rejected": {"batch_id_reused": {"batches": 1, "samples": 2}}}
        assert st["samples"]["produced"] == 0 and st["samples"]["delivered"] == 0
        # its samples were not received: b's batch under a new ID is taken
        r.batch(b, gb["lease"], gb["epoch"], gb["samples"], batch_id="x-2")
        assert rows(r.core)["x-2"] == (b, "queued", 2) and len(rows(r.core)) == 2
