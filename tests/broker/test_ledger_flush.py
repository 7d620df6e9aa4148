"""The ledger's flush drops writes a later write of the same row makes void (ledger._coalesce):
the stored rows must be exactly what writing every transition gives."""

from __future__ import annotations

import random
import sqlite3

import pytest

from dflash.broker import ledger as ledger_mod
from dflash.broker.dispatch import QueuedBatch
from dflash.broker.ledger import Ledger


def _transitions(led: Ledger, seed: int) -> None:
    """A random run's worth of moves: leases, arrivals, deliveries, losses and acks, in
    the orders a broker makes them (a batch is delivered after it arrived, and so on)."""
    rng = random.Random(seed)
    led.leased(1, 0, "p1", list(range(40)))
    led.epoch_started(0, 7, 40)
    queued, out, n = [], [], 0
    for s in range(40):
        b = QueuedBatch(f"p1-{s}", "p1", 1, 0, [s], 5, 100, [])
        led.produced(b)
        queued.append(b)
        while queued and rng.random() < 0.6:  # deliver some, in order
            b = queued.pop(0)
            b.deliveries += 1
            led.delivered(b, "c1")
            out.append(b)
        if out and rng.random() < 0.15:  # the consumer is lost: what it held comes back
            for b in out:
                led.requeued(b)
            queued[:0], out = out, []
        while out and rng.random() < 0.5:
            n += 1
            led.trained(out.pop(0), "c1", n)
    led.released(0, [39])  # a lease given back after all
    led.skipped(0, [(38, "too long")])


def _dump(path) -> dict:
    db = sqlite3.connect(path)
    try:
        return {t: db.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall() for t in ("samples", "batches", "leases")}
    finally:
        db.close()


@pytest.mark.parametrize("seed", range(5))
def test_coalesced_flush_stores_exactly_what_every_write_would(tmp_path, monkeypatch, seed):
    led = Ledger(tmp_path / "coalesced.sqlite")
    _transitions(led, seed)
    ops = list(led._ops)
    kept = ledger_mod._coalesce(ops)
    led.flush()
    led.close()

    monkeypatch.setattr(ledger_mod, "_coalesce", lambda ops: ops)  # every write, as before
    full = Ledger(tmp_path / "full.sqlite")
    full._ops = ops  # the very same rows, timestamps included
    full.flush()
    full.close()

    assert _dump(tmp_path / "coalesced.sqlite") == _dump(tmp_path / "full.sqlite")
    assert len(kept) < len(ops)  # it did drop writes
    batches = _dump(tmp_path / "full.sqlite")["batches"]
    assert all(row[11] is not None for row in batches)  # every batch keeps when it was received
