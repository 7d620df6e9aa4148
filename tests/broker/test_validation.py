"""Validation (PROTOCOL.md 3): every kind of bad message is refused with a logged reason
naming the sender, while a well-behaved producer/consumer pair runs to the end of the
stream through the same broker."""

from __future__ import annotations

import os
import threading

import msgpack
import zmq
from tests.harness.fakes import FakeConsumer, FakeProducer, batch_frames, pack
import pytest

pytestmark = pytest.mark.integration

N_SAMPLES = 40


def _control_case(endpoint: str, ident: bytes, frames: list[bytes]) -> dict | None:
    """Send `frames` from a DEALER with identity `ident`; return the broker's answer."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, ident)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send_multipart(frames)
        return msgpack.unpackb(s.recv_multipart()[0]) if s.poll(3000) else None
    finally:
        s.close()


def _batch(producer: str, run: str, **override) -> list[bytes]:
    frames = batch_frames(run, producer, f"{producer}-1", 1, 0, [0, 1])
    h = msgpack.unpackb(frames[0])
    h.update(override)
    return [msgpack.packb(h), *frames[1:]]


def test_bad_messages_are_refused_and_named_while_a_good_pair_finishes(start_broker):
    b = start_broker("--lease-size", "8")
    run = b.run_id
    prod = FakeProducer(b.control, "good-prod", n_samples=N_SAMPLES, delay_s=0.03)
    cons = FakeConsumer(b.control, "good-cons", train_s=0.005)
    threads = [threading.Thread(target=prod.run_to_end), threading.Thread(target=cons.run_to_end)]
    for t in threads:
        t.start()

    hello = pack("hello", role="producer", instance="x", host="h", pid=1)
    control_cases = {  # identity -> (frames, what the logged reason must say)
        b"bad-truncated": ([hello[:-3]], "not valid msgpack"),
        b"bad-unknown-type": ([pack("explode")], "unknown message type"),
        b"bad-non-map": ([msgpack.packb([1, 2, 3])], "not a map"),
        b"bad-random": ([os.urandom(64)], ""),
        b"bad-frames": ([pack("heartbeat", run, stats={}, tensors=[{"name": "a", "dtype": "uint8", "shape": [4]}])],
                        "tensors but 0 frames"),
        b"bad-fields": ([pack("lease", run, want="many")], "field 'want'"),
    }
    answers = {ident: _control_case(b.control, ident, frames) for ident, (frames, _) in control_cases.items()}
    version = _control_case(b.control, b"bad-version", [msgpack.packb({"v": 99, "type": "hello"})])

    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(f"tcp://127.0.0.1:{b.port + 1}")
    data_cases = {  # expected `peer` in the log -> (frames, what the reason must say)
        "addr:127.0.0.1#1": ([_batch("x", run)[0][:-5], b"", b"", b""], "not valid msgpack"),
        "addr:127.0.0.1#2": ([os.urandom(100)], ""),
        "addr:127.0.0.1#3": ([msgpack.packb("just a string")], "not a map"),
        "evil-count": (_batch("evil-count", run)[:-1], "3 tensors but 2 frames"),
        "evil-nbytes": (_batch("evil-nbytes", run)[:-1] + [b"\0" * 7], "frame has 7 bytes"),
        "evil-shape": (_batch("evil-shape", run, tensors=[{"name": "input_ids", "dtype": "int32",
                                                           "shape": [-8]}])[:2], "bad shape"),
        "evil-ndim": (_batch("evil-ndim", run, tensors=[{"name": "input_ids", "dtype": "int32",
                                                         "shape": [1] * 9}])[:2], "bad shape"),
        "evil-absurd": (_batch("evil-absurd", run, tensors=[{"name": "input_ids", "dtype": "int32",
                                                             "shape": [2**39, 2**39]}])[:2], "limit"),
        "evil-huge": (_batch("evil-huge", run, tensors=[{"name": "input_ids", "dtype": "int32",
                                                         "shape": [2**30]}])[:2], "limit"),
        "evil-version": (_batch("evil-version", run, v=2), "version 2"),
        "evil-type": ([pack("grant", run, lease=1, epoch=0, samples=[], end=False, producer="evil-type")],
                      "not accepted on this socket"),
        "evil-dtype": (_batch("evil-dtype", run, tensors=[{"name": "input_ids", "dtype": "complex64",
                                                           "shape": [8]}])[:2], "not on the whitelist"),
    }
    for frames, _ in data_cases.values():
        push.send_multipart(frames)

    # a peer with a session misbehaving is named by its peer ID
    noisy = FakeConsumer(b.control, "noisy")
    noisy.send("credit", credit=-5)
    noisy_reject = noisy.ctl.recv_multipart() if noisy.ctl.poll(3000) else None
    noisy.send("bye", reason="done")

    for t in threads:
        t.join(30)
    assert b.proc.wait(15) == 0, "the broker did not finish the good pair's stream"
    push.close()

    # the good pair got everything
    assert sorted(s for r in cons.received for s in r["samples"]) == list(range(N_SAMPLES))
    assert all(r["ids_ok"] for r in cons.received)
    assert cons.stopped == "end_of_stream"

    bad = b.events("broker.bad_message")
    for ident, (_, must_say) in control_cases.items():
        hits = [e for e in bad if e["socket"] == "control" and e["peer"] == ident.hex()]
        assert hits and must_say in hits[0]["reason"], (ident, hits)
        assert answers[ident]["type"] == "reject" and answers[ident]["code"] == "bad_message"
    assert version["code"] == "version" and "version 99" in version["reason"]
    assert any(e["identity"] == b"bad-version".hex() and e["code"] == "version"
               for e in b.events("broker.peer_rejected"))
    for peer, (_, must_say) in data_cases.items():
        hits = [e for e in bad if e["socket"] == "data_in" and e["peer"] == peer.split("#")[0]
                and must_say in e["reason"]]
        assert hits, (peer, must_say, [e for e in bad if e["socket"] == "data_in"])
    assert msgpack.unpackb(noisy_reject[0])["code"] == "bad_message"
    assert any(e["peer"] == noisy.peer and "negative" in e["reason"] for e in bad)
    assert not b.events("broker.internal_error")
