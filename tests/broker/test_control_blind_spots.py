"""Control-plane blind spots (issue 19, finding 10), against a real broker process with
hand-written DEALERs: a reject says which message it answers; a peer whose connection was
closed and reopened (new ROUTER identity) can say hello again and keeps its session; a
control message over the limit closes the connection, and the peer learns why on its
next message instead of being refused for good."""

from __future__ import annotations

import os
import socket

import msgpack
import pytest
import zmq

from tests.harness.broker import BrokerProc

pytestmark = pytest.mark.integration

HOST = socket.gethostname()


class Dealer:
    def __init__(self, b: BrokerProc, routing_id: bytes | None = None):
        self.s = zmq.Context.instance().socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        if routing_id:
            self.s.setsockopt(zmq.ROUTING_ID, routing_id)
        self.s.connect(b.control)
        self.run = None

    def send(self, type_: str, **fields) -> None:
        h = {"v": 1, "type": type_, **fields}
        if self.run and type_ != "hello":
            h["run"] = self.run
        self.s.send(msgpack.packb(h))

    def recv(self, timeout_s: float = 5.0) -> dict:
        assert self.s.poll(int(timeout_s * 1000)), "no answer from the broker"
        return msgpack.unpackb(self.s.recv_multipart()[0])

    def hello(self, instance: str, pid: int, role: str = "consumer") -> dict:
        self.send("hello", role=role, instance=instance, host=HOST, pid=pid, gpu=None, config={})
        h = self.recv()
        if h["type"] == "welcome":
            self.run = h["run"]
        return h

    def close(self) -> None:
        self.s.close()


@pytest.fixture
def broker(tmp_path):
    b = BrokerProc(tmp_path / "runs", ["--num-samples", "8", "--timeout-s", "30"])
    yield b
    b.proc.kill()  # sessions left open on purpose: no drain to wait for
    b.proc.wait(10)


def test_a_reject_after_the_handshake_says_which_message_it_answers(broker):
    d = Dealer(broker)
    assert d.hello("echo", os.getpid())["type"] == "welcome"
    d.send("ack", batch_ids=["p1-1", "p1-2"], step="seven")  # step of the wrong type
    r = d.recv()
    assert r["type"] == "reject" and r["code"] == "bad_message"
    assert r["answers"] == {"type": "ack", "step": "seven", "batch_ids": ["p1-1", "p1-2"], "n_batch_ids": 2}
    d.send("credit", credit=-3)
    r = d.recv()
    assert r["code"] == "bad_message" and r["answers"] == {"type": "credit", "credit": -3}
    d.send("lease", want=4)  # a producer's message from a consumer
    assert d.recv()["answers"] == {"type": "lease", "want": 4}
    d.close()


def test_a_reconnected_peer_says_hello_again_and_keeps_its_session(broker):
    pid = 4_000_000 + os.getpid() % 1000  # a process of ours, as far as the broker can tell
    first = Dealer(broker)
    w = first.hello("recon", pid)
    peer = w["peer"]
    first.close()  # the connection is gone; the process is not: it reconnects
    again = Dealer(broker)
    again.run = w["run"]
    again.send("heartbeat", stats={})
    r = again.recv()
    assert r["code"] == "unknown_peer" and r["answers"] == {"type": "heartbeat"}
    assert "control limit" in r["reason"] and "say hello again" in r["reason"]
    w2 = again.hello("recon", pid)
    assert w2["type"] == "welcome" and w2["peer"] == peer, w2  # the same session, not duplicate_instance
    again.send("heartbeat", stats={})
    got = [again.recv()["type"] for _ in range(3)]
    assert got == ["heartbeat"] * 3  # accepted (the broker beats back), no reject
    ev = broker.wait_event("broker.peer_reconnected")
    assert ev["peer"] == peer
    st = broker.ask()
    assert [p["peer"] for p in st["peers"] if p["role"] == "consumer"] == [peer]
    # Another process with that name is still refused while the session lives.
    other = Dealer(broker)
    assert other.hello("recon", pid + 1)["code"] == "duplicate_instance"
    other.close()
    again.close()


def test_an_oversized_control_message_costs_the_connection_not_the_session(broker):
    pid = 4_100_000 + os.getpid() % 1000
    d = Dealer(broker)
    w = d.hello("big", pid)
    d.send("heartbeat", stats={"blob": "x" * (3 << 20)})  # over the 1 MiB header limit: ZeroMQ drops the link
    d.send("heartbeat", stats={})  # goes out on the reconnected link, under a new identity
    r = d.recv()
    assert r["code"] == "unknown_peer" and "control limit of" in r["reason"]
    assert d.hello("big", pid)["peer"] == w["peer"]
    d.close()
