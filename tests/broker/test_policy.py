"""The broker's policy pieces on their own: leases, dispatch, the ledger, pacing, the
relay's zero-copy send, and option parsing."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections import OrderedDict
from dataclasses import dataclass, field

import pytest
import zmq

from dflash.broker.config import BrokerConfig, auto_broker_io_threads, parse_port_range, usable_cpus
from dflash.runtime.command_line import parse_bytes
from dflash.broker.dispatch import BatchQueue, Round
from dflash.broker.leases import LeasePool, StaleBatch
from dflash.protocol.sample_order import epoch_order
from dflash.broker.ledger import Ledger
from dflash.broker.liveness import RateLimit, RateMeter
from tests.harness.core_rig import queued

pytestmark = pytest.mark.integration


# ---------------------------------------------------------------- leases


def test_epochs_cover_every_sample_once_in_a_seeded_order():
    pool = LeasePool(epochs=2, seed=7, n_samples=10)
    got = {0: [], 1: []}
    while (lease := pool.grant("p1", 3)) is not None:
        got[lease.epoch] += lease.samples
        pool.arrived(lease.id, "p1", lease.epoch, lease.samples)
        assert pool.close_if_complete(lease)
    assert sorted(got[0]) == sorted(got[1]) == list(range(10))
    assert got[0] == epoch_order(7, 0, 10) and got[0] != got[1]  # reshuffled per epoch
    assert epoch_order(7, 0, 10) == epoch_order(7, 0, 10) != epoch_order(8, 0, 10)
    assert pool.finished()


def test_lost_producer_samples_go_to_the_front_and_late_batches_are_stale():
    pool = LeasePool(epochs=1, seed=0, n_samples=20)
    a = pool.grant("p1", 4)
    b = pool.grant("p1", 4)
    pool.arrived(a.id, "p1", 0, a.samples[:1])
    returned = pool.release("p1")
    assert [le.id for le, _ in returned] == [a.id, b.id]
    c = pool.grant("p2", 7)
    assert c.samples == a.samples[1:] + b.samples  # oldest lease first, ahead of fresh ones
    with pytest.raises(StaleBatch):
        pool.arrived(a.id, "p1", 0, a.samples[1:2])  # the lost producer's late batch
    with pytest.raises(StaleBatch):
        pool.arrived(c.id, "p2", 0, [a.samples[0]])  # a sample c does not hold
    pool.arrived(c.id, "p2", 0, c.samples[:2])
    with pytest.raises(StaleBatch):
        pool.arrived(c.id, "p2", 0, c.samples[:1])  # already received


def test_lease_completes_with_skipped_samples_and_caps_open_leases():
    pool = LeasePool(epochs=1, seed=0, n_samples=100)
    le = pool.grant("p1", 4)
    pool.arrived(le.id, "p1", 0, le.samples[:2])
    assert not pool.close_if_complete(le)
    skipped = pool.skip(le, [[le.samples[2], "too long"], [le.samples[3], "bad row"], [999, "not mine"]])
    assert [s for s, _ in skipped] == le.samples[2:] and pool.close_if_complete(le)
    leases = [pool.grant("p1", 1) for _ in range(5)]
    assert leases[-1] is None  # MAX_OPEN_LEASES = 4


# ---------------------------------------------------------------- dispatch


@dataclass(eq=False)
class FakeConsumer:
    name: str
    credit: int = 0
    last_served: int = 0
    in_flight: OrderedDict = field(default_factory=OrderedDict)
    connected: bool = True


def _batch(i: int, nbytes: int = 10):
    return queued(f"p1-{i}", [i], 4, nbytes)


def deal(q: BatchQueue, consumers: list, take) -> list:
    """One dispatch.Round, each pick's send answered by `take(consumer)`: what went where."""
    r, sent = Round(q, consumers), []
    while (pick := r.offer()) is not None:
        c, b = pick
        if take(c):
            r.took(c, 0.0)
            sent.append((c, b))
        else:
            r.refused(c)
    return sent


def test_dispatch_oldest_first_least_recently_served_first_and_only_against_credit():
    q = BatchQueue(capacity_bytes=35)
    for i in range(4):
        q.push(_batch(i))
    assert not q.has_room()  # 40 bytes > 35: data in stops being read
    a, b, c = FakeConsumer("a", credit=2), FakeConsumer("b", credit=1), FakeConsumer("c", connected=False, credit=5)
    sent = deal(q, [a, b, c], lambda con: con.connected)
    assert [(con.name, bt.batch_id) for con, bt in sent] == [("a", "p1-0"), ("b", "p1-1"), ("a", "p1-2")]
    assert (a.credit, b.credit, c.credit) == (0, 0, 5) and len(q) == 1
    # delivered but not acked is still held (for redelivery), so it still counts: 10 + 30
    assert not q.has_room() and (q.bytes, q.in_flight_bytes) == (10, 30)
    q.release(b.in_flight.pop("p1-1"))  # b acked
    assert q.has_room()
    # a lost consumer's batches go back in front of everything, oldest first
    q.requeue(list(a.in_flight.values()))
    assert (q.bytes, q.in_flight_bytes) == (30, 0)
    assert [q.pop().batch_id for _ in range(3)] == ["p1-0", "p1-2", "p1-3"]


# ---------------------------------------------------------------- ledger


def test_ledger_keeps_up_with_thousands_of_samples_per_second(tmp_path):
    # It keeps up by writing many transitions per transaction (one per --flush_s): counted
    # here, at 16,000 samples/s of an injected clock, rather than timed (a loaded machine
    # makes any rate bound flaky).
    now = [0.0]
    led = Ledger(tmp_path / "ledger.sqlite", flush_s=0.2, clock=lambda: now[0])
    transactions = []
    write = led._write
    led._write = lambda ops: transactions.append(len(ops)) or write(ops)  # the real write, counted
    n, per = 20_000, 16
    for lease in range(n // per):
        samples = list(range(lease * per, (lease + 1) * per))
        led.leased(lease + 1, 0, "p1", samples)
        b = queued(f"p1-{lease}", samples, 64, 1000, lease=lease + 1)
        led.produced(b)
        led.delivered(b, "c1")
        led.trained(b, "c1", step=lease)
        now[0] += 0.001  # 1 ms per lease of 16 samples
        led.maybe_flush()
    assert led.committed(n // per, "ckpt", "c1") == n
    # 1,250 leases x 5 transitions of 16 samples each went in a handful of transactions,
    # a batch's and a sample's moves before a flush written once (their last state)
    assert 6 <= len(transactions) <= 8, transactions  # one per 0.2 s of the clock, the last at the commit
    assert sum(transactions) < 3 * n, sum(transactions)
    assert led.counts["committed"] == n and led.counts["trained"] == 0
    led.close()
    db = sqlite3.connect(tmp_path / "ledger.sqlite")
    assert db.execute("SELECT state, COUNT(*) FROM samples GROUP BY state").fetchall() == [("committed", n)]
    db.close()


def test_ledger_survives_a_broker_crash(tmp_path):
    # A child process writes, flushes, queues more, and dies without closing.
    code = f"""
import os
from dflash.broker.ledger import Ledger
from dflash.broker.dispatch import Queued
from dflash.protocol.messages import Batch
led = Ledger({str(tmp_path / 'l.sqlite')!r})
led.leased(1, 0, 'p1', [1, 2, 3])
b = Queued(Batch('p1-1', 'p1', 1, 0, [1, 2, 3], [4, 4, 4], [1]), 100, 0.0)
led.produced(b); led.delivered(b, 'c1'); led.trained(b, 'c1', 5)
led.committed(5, 'step-5', 'c1')
led.leased(2, 0, 'p1', [4])
led.sync()  # flushed and written (flush alone hands the write to the ledger's thread)
led.leased(3, 0, 'p1', [5])  # queued, never flushed
os._exit(9)
"""
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    led = Ledger(tmp_path / "l.sqlite")
    rows = dict(led.db.execute("SELECT sample, state FROM samples").fetchall())
    assert rows == {1: "committed", 2: "committed", 3: "committed", 4: "leased"}
    assert led.db.execute("SELECT step, checkpoint, samples FROM commits").fetchall() == [(5, "step-5", 3)]
    assert led.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    led.close()


# ---------------------------------------------------------------- pacing, relay, options


def test_rate_meter_and_rate_limit():
    m = RateMeter(window_s=10)
    for i in range(100):
        m.add(1, 100 + i * 0.05)  # 20 per second for 5 s
    assert 18 <= m.rate(now=105) <= 21
    assert m.rate(now=200) == 0.0
    rl = RateLimit(per_s=3)
    results = [rl.allow("x", now=1.0)[0] for _ in range(10)]
    assert results.count(True) == 3
    assert rl.allow("x", now=2.5) == (True, 7)  # reports what it suppressed


class RecordingSocket:
    """Stands in for a consumer's PUSH: records each frame sent; a `full` one refuses
    every send as a full (or unconnected) PUSH does with NOBLOCK."""

    def __init__(self, full: bool = False):
        self.calls, self.full = [], full

    def send(self, frame, flags=0, copy=True):
        if self.full:
            raise zmq.Again()
        self.calls.append((frame, flags, copy))

    def messages(self) -> list[list]:
        """The frames of each whole message sent (SNDMORE joins frames into one)."""
        out, cur = [], []
        for frame, flags, _ in self.calls:
            cur.append(frame)
            if not flags & zmq.SNDMORE:
                out.append(cur)
                cur = []
        return out


def test_relay_sends_the_received_frames_themselves_without_copy(tmp_path):
    from dflash.broker.server import send_first

    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    push.send_multipart([b"h", b"x" * (1 << 20)])
    frames = pull.recv_multipart(copy=False)
    sock = RecordingSocket()
    assert send_first([(7000, sock)], frames) == 7000
    assert [f for f, _, _ in sock.calls] == frames and all(a is b for a, b in zip((f for f, _, _ in sock.calls), frames))
    assert all(isinstance(f, zmq.Frame) for f, _, _ in sock.calls)  # the zmq frames themselves
    assert all(copy is False and flags & zmq.NOBLOCK for _, flags, copy in sock.calls)
    assert [bool(flags & zmq.SNDMORE) for _, flags, _ in sock.calls] == [True, False]  # one message
    pull.close()
    push.close()


def test_a_batch_goes_to_the_first_pipe_that_takes_it_and_stays_queued_when_none_does():
    from dflash.broker.server import send_first

    s0, s1 = RecordingSocket(full=True), RecordingSocket()  # not connected, or full: the next one takes it
    assert send_first([(7000, s0), (7001, s1)], [b"h0", b"t"]) == 7001 and s1.messages() == [[b"h0", b"t"]]
    s1.full = True
    assert send_first([(7000, s0), (7001, s1)], [b"h1", b"t"]) is None  # no stream took it: it stays queued
    assert s0.messages() == [] and len(s1.messages()) == 1


def test_option_parsing_and_config_checks():
    assert parse_bytes("4GiB") == 4 << 30 and parse_bytes("512MB") == 512_000_000 and parse_bytes("10") == 10
    assert parse_port_range("5557-5620") == (5557, 5620) and parse_port_range("6000") == (6000, 6000)
    for bad in ("lots", "4 parsecs"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    BrokerConfig().check()
    for kw in ({"data_out_ports": (5550, 5560)}, {"timeout_s": 1.0}, {"epochs": 0}, {"instance": "a/b"},
               {"io_threads": -1}, {"io_threads": 17}, {"data_streams": -1}, {"data_streams": 9},
               {"data_streams": 2, "data_out_ports": (5557, 5557)}):
        with pytest.raises(ValueError):
            BrokerConfig(**kw).check()
    assert BrokerConfig(io_threads=3).io_thread_count() == 3
    # data streams: one per pipe thread, at most 2 by default; asked for, as many as asked
    assert [BrokerConfig().stream_count(n) for n in (1, 2, 3)] == [1, 2, 2]
    assert BrokerConfig(data_streams=3).stream_count(1) == 3
    # auto: more I/O threads only where cores are to spare (one measured faster on 2 cores)
    assert [auto_broker_io_threads(n) for n in (1, 2, 7, 8, 15, 16, 24, 32, 128)] == [1, 1, 1, 2, 2, 3, 4, 5, 5]
    assert BrokerConfig().io_thread_count() == auto_broker_io_threads(usable_cpus())
    assert BrokerConfig(bind="10.0.0.2").host_to_advertise("h") == "10.0.0.2"
    assert BrokerConfig().host_to_advertise("h") == "h"


def test_cli_refuses_bad_options_in_one_line():
    r = subprocess.run([sys.executable, "-m", "dflash.broker.broker_command", "--queue-bytes", "lots"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "lots" in r.stderr


def test_incomplete_lease_returns_after_grace_and_its_clock_holds_while_the_queue_is_full():
    pool = LeasePool(epochs=1, seed=0, n_samples=10)
    le = pool.grant("p1", 4)
    pool.arrived(le.id, "p1", 0, le.samples[:2])
    le.done_at = 100.0
    assert pool.overdue(105.0, 10.0) == []
    pool.hold_clocks(20.0)  # the broker was not reading data in for 20 s
    assert pool.overdue(125.0, 10.0) == []
    assert pool.overdue(131.0, 10.0) == [le]
    assert pool.give_back(le) == le.samples[2:]
    assert pool.grant("p2", 2).samples == le.samples[2:]
