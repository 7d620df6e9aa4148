"""The ledger queues writes and keeps only a row's last write before a flush: the stored
rows must be exactly what writing every transition as it happens gives."""

from __future__ import annotations

import random
import sqlite3
import time as time_module

import pytest

from dflash.broker import ledger as ledger_mod
from dflash.broker.ledger import Ledger
from tests.harness.core_rig import queued as held

pytestmark = pytest.mark.unit


def _transitions(led: Ledger, seed: int, flush_each: bool = False) -> None:
    """A random run's worth of moves: leases, arrivals, deliveries, losses and acks, in
    the orders a broker makes them (a batch is delivered after it arrived, and so on).
    `flush_each`: every move written at once, as if nothing were queued."""
    rng = random.Random(seed)
    if flush_each:
        for name in ("leased", "epoch_started", "produced", "delivered", "requeued", "trained", "released",
                     "skipped"):
            move = getattr(led, name)
            setattr(led, name, lambda *a, _move=move: (_move(*a), led.flush()))
    led.leased(1, 0, "p1", list(range(40)))
    led.epoch_started(0, 7, 40)
    queued, out, n = [], [], 0
    for s in range(38):  # 38 arrive; 38 is skipped and 39 given back (never made)
        b = held(f"p1-{s}", [s], 5, 100)
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
    led.skipped(0, [(38, "too long")])
    led.released(0, [39])  # its producer was lost


def _dump(path) -> dict:
    db = sqlite3.connect(path)
    try:
        return {t: db.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall() for t in ("samples", "batches", "leases")}
    finally:
        db.close()


class Clock:
    """time.time() for the ledger: 1, 2, 3, ... so two runs write the same timestamps."""

    def __init__(self):
        self.t = 0.0

    def time(self) -> float:
        self.t += 1.0
        return self.t

    monotonic = staticmethod(time_module.monotonic)
    perf_counter = staticmethod(time_module.perf_counter)


@pytest.mark.parametrize("seed", range(5))
def test_one_flush_stores_exactly_what_a_flush_after_every_write_would(tmp_path, monkeypatch, seed):
    """The ledger keeps only a batch row's and a sample state's last write before a flush;
    the rows stored must be those of writing every transition as it happens."""
    monkeypatch.setattr(ledger_mod, "time", Clock())
    every = Ledger(tmp_path / "every.sqlite")
    _transitions(every, seed, flush_each=True)
    every.close()

    monkeypatch.setattr(ledger_mod, "time", Clock())
    once = Ledger(tmp_path / "once.sqlite")
    _transitions(once, seed)
    queued = len(once._ops) + len(once._batches) + len(once._states)
    once.close()

    assert _dump(tmp_path / "once.sqlite") == _dump(tmp_path / "every.sqlite")
    assert queued < 40 * 6  # it did drop writes: a batch makes 2 rows, not 6 (3 moves x (batch + sample))
    batches = _dump(tmp_path / "once.sqlite")["batches"]
    assert len(batches) == 38 and all(row[11] is not None for row in batches)  # each keeps when it was received
