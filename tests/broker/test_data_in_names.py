"""Refusals on data in name the producer, not only its host (issue 29, item 8): two
producers on one host share an IP, so each data-in connection announces its peer ID and
instance (ZMTP metadata, PROTOCOL.md 1), and the broker's lines name them. A batch that
does not fit the run's target ends the session of the producer whose own connection sent
it, and of nobody else. A real broker process, two real `ProducerLink`s in this process."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import msgpack
import pytest
import torch
import zmq

from dflash.protocol import codec
from dflash.protocol.errors import Rejected
from dflash.protocol.links import ProducerLink
from dflash.protocol.batch import Batch
from dflash.runtime.logs import close_logging, setup_logging
from tests.harness.broker import BrokerProc

pytestmark = pytest.mark.integration

CFG = {"target": "tiny", "layer_ids": [0, 1], "hidden_size": 4, "vocab_size": 64,
       "dataset": {"n_samples": 8, "fingerprint": "x"}}


@pytest.fixture
def broker(tmp_path):
    b = BrokerProc(tmp_path / "runs", ["--num-samples", "8", "--timeout-s", "30"])
    yield b
    b.proc.kill()
    b.proc.wait(10)


@pytest.fixture
def links(broker):
    setup_logging("producer", "names", level="warning")
    made = []
    for name in ("prod-a", "prod-b"):
        link = ProducerLink(broker.control, name, config=CFG, runs_dir=broker.runs_dir, connect_timeout_s=10)
        link.start()
        made.append(link)
    yield made
    try:
        for link in made:
            try:
                link.close("done", flush_timeout_s=2)
            except Rejected:
                pass
    finally:
        close_logging()


SEQ = itertools.count()  # batch IDs: one sequence for every link of the test


def _batch(link: ProducerLink, lease: int, epoch: int, s: int, width: int = 8) -> Batch:
    tensors = {"input_ids": torch.full((3,), s, dtype=torch.int32), "loss_mask": torch.ones(3, dtype=torch.uint8),
               "hidden": torch.zeros((3, width), dtype=torch.bfloat16)}
    return Batch(f"{link.peer_id}-{next(SEQ)}", link.peer_id, lease, epoch, [s], [3], [0, 1], tensors=tensors)


def test_stale_and_unreadable_messages_name_each_producer_of_one_host(broker, links):
    b = links[1]
    for link in links:
        link.push_batch(_batch(link, 999, 0, 1))  # a lease it does not hold: stale
    stale = {e["producer"]: e for e in (broker.wait_event("broker.batch_stale", pred=lambda e, p=link.peer_id:
                                                          e["producer"] == p) for link in links)}
    for link in links:
        ev = stale[link.peer_id]
        assert ev["peer_instance"] == link.instance and ev["connection_instance"] == link.instance
        assert ev["connection_peer"] == link.peer_id and ev["peer_address"] == "127.0.0.1"

    # A message whose header does not parse: named by the peer ID its connection announces
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.setsockopt(zmq.METADATA, f"X-Peer:{b.peer_id}".encode())
    push.setsockopt(zmq.METADATA, f"X-Instance:{b.instance}".encode())
    push.connect(b.welcome.data_in)
    push.send(msgpack.packb({"v": 1, "type": "batch"})[:-2])
    ev = broker.wait_event("broker.bad_message", pred=lambda e: e["socket"] == "data_in")
    assert ev["peer"] == b.peer_id and ev["connection_instance"] == b.instance, ev
    push.close()


def test_a_batch_that_does_not_fit_ends_only_the_session_whose_connection_sent_it(broker, links):
    a, b = links
    ga = a.request_lease(2, timeout_s=10)
    gb = b.request_lease(2, timeout_s=10)
    assert ga.samples and gb.samples  # both lease (a share of the 8 each)

    # Sent from elsewhere while naming b: refused, counted, and b keeps its session and lease
    forged = replace(_batch(b, gb.lease, gb.epoch, gb.samples[0], width=12), batch_id="forged-1")
    foreign = zmq.Context.instance().socket(zmq.PUSH)
    foreign.setsockopt(zmq.LINGER, 1000)
    foreign.connect(b.welcome.data_in)
    foreign.send_multipart(codec.encode(forged.to_header(b.run_id), forged.tensors))
    ev = broker.wait_event("broker.batch_rejected", pred=lambda e: e["batch_id"] == "forged-1")
    assert ev["fault"] == "hidden_width" and ev["own_connection"] is False and ev["peer"] == b.peer_id
    assert ev["peer_instance"] == b.instance and ev["connection_peer"] is None
    foreign.close()
    b.push_batch(_batch(b, gb.lease, gb.epoch, gb.samples[0]))  # its own correct copy is taken
    time.sleep(0.5)
    assert broker.ask()["samples"]["produced"] == 1

    # Sent by a's own link: a is told (bad_batch) and its session ends, its leases back to the pool
    a.push_batch(_batch(a, ga.lease, ga.epoch, ga.samples[0], width=12))
    ev = broker.wait_event("broker.batch_rejected", pred=lambda e: e["peer"] == a.peer_id)
    assert ev["own_connection"] is True and ev["connection_instance"] == a.instance
    lost = broker.wait_event("broker.peer_lost", pred=lambda e: e["peer"] == a.peer_id)
    assert lost["held"]["samples_returned"] == len(ga.samples) and "hidden_width" in lost["reason"]
    deadline = time.monotonic() + 10
    while a.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert isinstance(a.error, Rejected) and a.error.code == "bad_batch"
    st = broker.ask()
    assert st["bad_batches"] == {"rejected": {"hidden_width": {"batches": 2, "samples": 2}}}
    assert [p["peer"] for p in st["peers"]] == [b.peer_id]
    gone = st["gone"][-1]
    assert gone["peer"] == a.peer_id and gone["failure"]["code"] == "bad_batch"


def test_a_batch_under_an_id_the_run_accepted_before_is_refused_and_its_producer_told(broker, links):
    """Issue 36 item 4: once a's batch is acked (no longer queued), b's batch under its ID,
    on b's own lease and connection, would replace its ledger row: refused with
    `duplicate_batch_id`, counted, b's session ended."""
    from tests.harness.fakes import FakeConsumer

    a, b = links
    ga, gb = a.request_lease(2, timeout_s=10), b.request_lease(2, timeout_s=10)
    c = FakeConsumer(broker.control, "c")
    c.send("credit", credit=1)
    first = _batch(a, ga.lease, ga.epoch, ga.samples[0])
    a.push_batch(first)
    deadline = time.monotonic() + 10
    while not c.data.poll(50) and time.monotonic() < deadline:
        c.pump()
    assert msgpack.unpackb(c.data.recv_multipart()[0])["batch_id"] == first.batch_id
    c.send("ack", batch_ids=[first.batch_id], step=1)
    while (broker.ask() or {}).get("samples", {}).get("trained") != 1 and time.monotonic() < deadline:
        c.pump()
    b.push_batch(replace(_batch(b, gb.lease, gb.epoch, gb.samples[0]), batch_id=first.batch_id))
    ev = broker.wait_event("broker.batch_rejected", pred=lambda e: e["peer"] == b.peer_id)
    assert ev["fault"] == "batch_id_reused" and ev["own_connection"] is True and ev["batch_id"] == first.batch_id
    while b.error is None and time.monotonic() < deadline + 10:
        c.pump()
        time.sleep(0.05)
    assert isinstance(b.error, Rejected) and b.error.code == "duplicate_batch_id"
    st = broker.ask()
    assert st["bad_batches"] == {"rejected": {"batch_id_reused": {"batches": 1, "samples": 1}}}
    assert st["samples"]["trained"] == 1 and st["gone"][-1]["failure"]["code"] == "duplicate_batch_id"
    c.send("bye", reason="done")
