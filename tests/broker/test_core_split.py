"""A producer that asks with nothing gets part of another's lease (issue 36 item 3,
PROTOCOL.md 4.3 `revoke`/`release`): a real producer says hello only once its model is
loaded, so the first to arrive on a small dataset leased all of it and a later one made
nothing. Now, when the pool is empty and an asker holds no lease, the producer of the open
lease with most still to come is asked (`revoke {lease, n}`, n half of it) to give back what
it has not started; its `release` sends those samples to the front of the pool, and the
asker's next ask gets them. The same rule balances the tail of any run. BrokerCore in-process."""

from __future__ import annotations

import pytest

from tests.harness.core_rig import Rig, ledger_states, sent

pytestmark = pytest.mark.unit


def grant(r: Rig, identity: bytes, want: int = 256) -> dict:
    return sent(r.control(identity, "lease", want=want), "grant")[0].fields


def test_the_unstarted_part_of_a_lease_moves_to_a_producer_that_asks_with_nothing(tmp_path):
    with Rig(tmp_path, num_samples=8, lease_size=256) as r:
        r.hello(b"t0", "producer", revoke=True)
        g0 = grant(r, b"t0")
        assert len(g0["samples"]) == 8  # alone: the whole dataset is its share
        r.hello(b"t1", "producer", revoke=True)  # its model took longer to load
        out = r.control(b"t1", "lease", want=256)
        assert sent(out, "grant")[0].fields["samples"] == []
        (rv,) = sent(out, "revoke")
        assert rv.identity == b"t0" and rv.fields == {"lease": g0["lease"], "n": 4}
        # asked again before the answer: no second revoke of that lease
        assert sent(r.control(b"t1", "lease", want=256), "revoke") == []
        tail = g0["samples"][-3:]  # t0 started the batch holding sample 5 (n: up to 4, whole batches)
        r.control(b"t0", "release", lease=g0["lease"], samples=tail)
        g1, g2 = grant(r, b"t1"), grant(r, b"t1")  # in shares of what is left, for two producers
        assert g1["samples"] + g2["samples"] == tail and r.core.ledger.counts["leased"] == 8
        p0, p1 = r.peer(b"t0").id, r.peer(b"t1").id
        r.batch(p0, g0["lease"], g0["epoch"], g0["samples"][:5])
        for g in (g1, g2):
            r.batch(p1, g["lease"], g["epoch"], g["samples"])
        r.control(b"t0", "done", lease=g0["lease"], skipped=[])
        assert not r.core.work.pool.open and r.core.work.pool.finished()
        assert ledger_states(r.core) == {"produced": 8}
        # a batch of t0 carrying a sample it gave back would be stale: nothing counted twice
        r.batch(p0, g0["lease"], g0["epoch"], tail[:1], batch_id="late")
        assert r.status()["samples"]["produced"] == 8


def test_a_release_gives_back_only_what_is_still_to_come_of_its_own_lease(tmp_path):
    with Rig(tmp_path, num_samples=8, lease_size=256) as r:
        r.hello(b"t0", "producer", revoke=True)
        g0 = grant(r, b"t0")
        p0 = r.peer(b"t0").id
        r.batch(p0, g0["lease"], g0["epoch"], g0["samples"][:2])
        r.hello(b"t1", "producer", revoke=True)
        grant(r, b"t1")
        r.control(b"t1", "release", lease=g0["lease"], samples=g0["samples"])  # not t1's lease
        assert r.core.work.pool.pending() == 0
        r.control(b"t0", "release", lease=g0["lease"], samples=g0["samples"][:4] + [99])
        assert r.core.work.pool.pending() == 2  # the two made already stay made
        assert grant(r, b"t1")["samples"] + grant(r, b"t1")["samples"] == g0["samples"][2:4]


def test_a_producer_that_does_not_answer_revoke_is_never_sent_one(tmp_path):
    with Rig(tmp_path, num_samples=8, lease_size=256) as r:
        r.hello(b"t0", "producer")  # no config.revoke: an older or independent producer
        grant(r, b"t0")
        r.hello(b"t1", "producer", revoke=True)
        out = r.control(b"t1", "lease", want=256)
        assert sent(out, "revoke") == [] and sent(out, "grant")[0].fields["samples"] == []
