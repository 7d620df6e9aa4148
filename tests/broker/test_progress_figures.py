"""Progress figures by samples trained (issue 29, item 6), on BrokerCore in-process: the
epoch shown is the one training is in, not the one leases come from (producers lease a
small dataset's next epoch long before it is trained), and a resumed run's trained and
committed figures count the samples its parent committed, as its fraction does."""

from __future__ import annotations

import pytest

from dflash.broker.resume import Parent
from dflash.tools.status_view import header

from tests.harness.core_rig import N, Rig

pytestmark = pytest.mark.unit


def _train(rig: Rig, batch_id: str, step: int) -> None:
    rig.dispatch()
    rig.control(b"cons", "ack", batch_ids=[batch_id], step=step)


def test_the_epoch_follows_samples_trained_not_leases(tmp_path):
    rig = Rig(tmp_path, epochs=2)
    try:
        rig.consumer(credit=1)  # one batch at a time: the rest stays queued, produced, untrained
        grants = [rig.produce() for _ in range(3)]
        ids = [f"{p}-{g['lease']}-{g['samples'][0]}" for p, g in grants]
        assert rig.core.work.pool.epoch == 1  # epoch 0 wholly leased, epoch 1 begun
        _train(rig, ids[0], 1)
        st = rig.status()
        pr = st["progress"]
        assert (pr["epoch"], pr["trained"], pr["done"], pr["total"]) == (0, 4, 4, 2 * N), pr
        assert pr["epochs_done"] == 0.5 and pr["fraction"] == 0.25
        assert st["samples"]["epoch"] == 1  # the ledger's view keeps the leases' epoch
        assert "progress epoch 1/2 (0.50 epochs done)  samples trained 4 committed 0 of 16 (25.0%)" in header(st)[1]
        assert rig.core.status.progress_fields(rig.now)["epoch"] == 0
        # Every sample of epoch 0 trained: training is in epoch 1 (shown 2/2), at the end too.
        rig.control(b"cons", "credit", credit=8)
        for step, bid in enumerate(ids[1:], 2):
            _train(rig, bid, step)
        assert rig.core.status.progress(rig.now)["epoch"] == 1 and rig.core.status.progress(rig.now)["trained"] == 12
    finally:
        rig.close()


def test_a_resumed_runs_trained_and_committed_count_what_it_inherited(tmp_path):
    inherited = [(0, s, "20260101T000000Z-aaaa", 3) for s in range(5)]
    committed = {0: bytearray([1] * 5 + [0] * (N - 5))}
    parent = Parent("20260101T000000Z-aaaa", tmp_path / "parent", 0, 1, {}, N, committed, inherited)
    rig = Rig(tmp_path / "child", parent=parent)
    try:
        rig.consumer()
        p, g = rig.produce(want=3)
        _train(rig, f"{p}-1-{g['samples'][0]}", 1)
        rig.control(b"cons", "commit", step=1, checkpoint="ckpt/step1")
        pr = rig.core.status.progress(rig.now)
        assert (pr["trained"], pr["committed"], pr["inherited"], pr["done"], pr["total"]) == (N, N, 5, N, N), pr
        assert pr["fraction"] == 1.0 and pr["epoch"] == 0
        line = rig.core.status.progress_fields(rig.now)
        assert (line["samples_trained"], line["samples_committed"], line["samples_inherited"]) == (N, N, 5)
        assert f"samples trained {N} committed {N} (incl. 5 from the resumed run) of {N} (100.0%)" in \
            header(rig.status())[1]
    finally:
        rig.close()
