"""Everything one peer can make the broker hold is bounded (issue 7, "bounded memory"):
frame size (ZMQ_MAXMSGSIZE), sessions (--max-peers), a session's hello config, leases,
credit, batches held for consumers that never ack (--queue-bytes), and the rate-limit
state kept per unknown sender."""

from __future__ import annotations

import time

import pytest
from tests.harness.spawn import rss_kib
from tests.harness.wait import wait_until
from tests.reliability.zmtp_raw import RawZmtp

from tests.harness.fakes import FakeConsumer, FakeProducer, Pumping, Rejected, batch_frames
from dflash.broker.config import data_in_frame_cap
from dflash.protocol.messages import CONTROL_MAX_BYTES
from dflash.broker.leases import MAX_OPEN_LEASES
from dflash.broker.replies import LogGate

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("sock", ["control", "data_in"])
def test_maxmsgsize_closes_a_connection_that_declares_a_huge_frame(brokers, sock):
    b = brokers("--max-message-bytes", "1MiB")
    port, kind = (b.port, b"DEALER") if sock == "control" else (b.port + 1, b"PUSH")
    rss0 = rss_kib(b.proc.pid)
    peers = []
    for _ in range(20):  # 20 x 1 TiB declared: nothing is allocated, the connection goes
        raw = RawZmtp("127.0.0.1", port, kind)
        raw.sock.sendall(raw.frame_header(1 << 40, more=False) + b"\x00" * 1024)
        assert raw.closed_by_peer(5.0), "the broker kept a connection that declared a 1 TiB frame"
        peers.append(raw)
    # Just over the frame cap, sent in full: refused as well, and not kept. (Data in caps
    # frames at twice --max-message-bytes, so that a batch just over the limit is read,
    # logged and refused rather than dropped silently: test_link_limits.py.)
    cap = CONTROL_MAX_BYTES if sock == "control" else data_in_frame_cap(1 << 20)
    raw = RawZmtp("127.0.0.1", port, kind)
    try:
        raw.send_frame(b"\x00" * (cap + (100 << 10)))
    except (ConnectionResetError, BrokenPipeError):
        pass  # closed while we were still sending: what we want
    assert raw.closed_by_peer(5.0)
    assert rss_kib(b.proc.pid) - rss0 < 16 * 1024
    assert b.ask() is not None  # still serving
    for p in [*peers, raw]:
        p.close()


def test_sessions_and_hello_configs_are_bounded(brokers):
    # These fakes beat only while they wait: a timeout no loaded machine reaches keeps c1 and
    # c2 live until they leave (the harness's 1.5 s let the broker drop c1 before c3 came).
    b = brokers("--max-peers", "2", "--timeout-s", "600")
    big = {"blob": "x" * (100 << 10)}
    with pytest.raises(Rejected, match="bad_message.*larger than 65536"):
        FakeConsumer(b.control, "fat", config=big)
    c1, c2 = FakeConsumer(b.control, "c1"), FakeConsumer(b.control, "c2")
    with pytest.raises(Rejected, match="full.*--max-peers"):
        FakeConsumer(b.control, "c3")
    c1.send("bye", reason="test")
    # c1's bye and c3's hello travel on two connections: the broker must have taken the bye first
    wait_until(lambda: any(g["instance"] == "c1" for g in (b.ask() or {}).get("gone", [])), 60, "c1 gone")
    c3 = FakeConsumer(b.control, "c3")  # a session that left frees its place
    for c in (c1, c2, c3):
        c.close()


def test_leases_and_credit_are_capped_whatever_a_peer_asks(brokers):
    b = brokers("--lease-size", "4", "--num-samples", "100")
    p = FakeProducer(b.control, "greedy", n_samples=100)
    grants = []
    for _ in range(3 * MAX_OPEN_LEASES):
        p.send("lease", want=10**6)
        grants.append(p.wait_for({"grant"}, 5))
    held = [g for g in grants if g["samples"]]
    assert len(held) == MAX_OPEN_LEASES and all(len(g["samples"]) == 4 for g in held)
    c = FakeConsumer(b.control, "c")
    c.send("credit", credit=2**40)
    c.pump()
    rows = wait_until(lambda: [r for r in (b.ask() or {}).get("peers", []) if r["instance"] == "c"], 5, "status")
    assert rows[0]["credit"] == 64
    p.close()
    c.close()


def test_batches_held_for_a_consumer_that_never_acks_stay_within_queue_bytes(brokers):
    """Delivered-but-unacked batches are kept for redelivery; they count against
    --queue-bytes, so a consumer that takes and never acks cannot make the broker
    hold more than that (plus one message)."""
    cap = 4000
    b = brokers("--queue-bytes", str(cap), "--lease-size", "64", "--num-samples", "64")
    hoarder = FakeConsumer(b.control, "hoarder", prefetch=64)
    hoarder.send("credit", credit=64)
    prod = FakeProducer(b.control, "p", n_samples=64, per_batch=1)
    prod.send("lease", want=64)
    g = prod.wait_for({"grant"}, 5)
    got = []
    with Pumping(hoarder, prod):
        for s in g["samples"]:  # 64 small batches: they fit in TCP buffers, so sends do not block
            prod.data.send_multipart(batch_frames(b.run_id, prod.peer, f"{prod.peer}-{s}", g["lease"], 0, [s]))
        time.sleep(1.0)
    while hoarder.data.poll(0):
        got.append(len(b"".join(hoarder.data.recv_multipart())))
    st = b.ask()
    held = st["queue"]["bytes"] + st["queue"]["in_flight_bytes"]
    one = max(got)
    # Credit 64 would take all 64 batches; the byte bound stops both reading and sending.
    assert 0 < len(got) < 64 and sum(got) <= cap + one and held <= cap + one, (len(got), sum(got), held)
    assert not st["queue"]["reading"] and st["queue"]["in_flight_batches"] == len(got)
    hoarder.close()
    prod.close()


def test_rate_limit_state_stays_bounded_under_invented_senders():
    gate = LogGate(0.0)
    for i in range(50_000):
        gate.allow(f"bad:control:{i:08x}", i * 1e-4)
        gate.allow(f"stale:sender-{i}", i * 1e-4)
    assert len(gate._senders._state) <= gate._senders.max_keys
    assert len(gate._kinds._state) <= 2


@pytest.mark.xfail(strict=True, reason="libzmq applies MAXMSGSIZE per frame and HWMs per complete message: "
                   "an endless multipart message is buffered whole (docs/SECURITY.md); strict, so a libzmq "
                   "that fixes it makes this XPASS and the doc gets updated")
def test_an_endless_multipart_message_is_bounded_without_curve(brokers):
    b = brokers()
    rss0 = rss_kib(b.proc.pid)
    raw = RawZmtp("127.0.0.1", b.port + 1, b"PUSH")
    for _ in range(48):  # 48 frames of 1 MiB, each under the limit, never a last frame
        raw.send_frame(b"\x00" * (1 << 20), more=True)
    time.sleep(0.5)
    grown = rss_kib(b.proc.pid) - rss0
    raw.close()
    assert grown < 16 * 1024, f"the broker buffered {grown // 1024} MiB of one unfinished message"
