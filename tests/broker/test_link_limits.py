"""Messages over a limit, and a control connection that ZeroMQ closed and reopened, with a
real broker process and the project's own client (`ProducerLink`, in this process). Issue 19,
finding 10: none of these may lose a message without a word.

- a batch over --max-message-bytes is refused by the link before it leaves, naming the
  options; one that arrives anyway (another client) is logged by the broker
  (broker.batch_too_large: size, limit, producer) and its producer told (`too_large`);
- a control message over the control limit is refused by the link at the call;
- a link whose control connection was closed and reopened keeps its session (a routing ID
  of its own), instead of every later message being refused `unknown_peer`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import pytest
import torch
import zmq

from tests.harness.broker import BrokerProc
from dflash.protocol import codec
from dflash.protocol.errors import MessageTooLarge, Rejected
from dflash.protocol.messages import Grant, Heartbeat
from dflash.protocol.batch import Batch
from dflash.protocol.fields import header
from dflash.protocol.links import ProducerLink
from dflash.runtime.logs import close_logging, setup_logging

pytestmark = pytest.mark.integration

LIMIT = 4096
CFG = {"target": "tiny", "layer_ids": [0, 1], "hidden_size": 2, "dataset": {"n_samples": 8, "fingerprint": "x"}}


@pytest.fixture
def broker(tmp_path):
    b = BrokerProc(tmp_path / "runs", ["--num-samples", "8", "--timeout-s", "30", "--max-message-bytes", str(LIMIT)])
    yield b
    b.proc.kill()
    b.proc.wait(10)


@pytest.fixture
def producer(broker):
    setup_logging("producer", "lim-prod", level="warning")  # as dflash-produce does: the link binds it to the run
    link = ProducerLink(broker.control, "lim-prod", config=CFG, runs_dir=broker.runs_dir, connect_timeout_s=10)
    link.start()
    yield link
    try:
        link.close("done", flush_timeout_s=2)
    finally:
        close_logging()


SEQ = itertools.count()


def _batch(link: ProducerLink, g: Grant, s: int, width: int) -> Batch:
    tensors = {"input_ids": torch.full((3,), s, dtype=torch.int32), "loss_mask": torch.ones(3, dtype=torch.uint8),
               "hidden": torch.zeros((3, width), dtype=torch.bfloat16)}
    return Batch(f"{link.peer_id}-{next(SEQ)}", link.peer_id, g.lease, g.epoch, [s], [3], [0, 1], tensors=tensors)


def test_a_batch_over_the_limit_is_refused_by_the_link_before_it_leaves(broker, producer):
    g = producer.request_lease(2, timeout_s=10)
    big = _batch(producer, g, g.samples[0], 1000)  # 6000 tensor bytes > LIMIT
    with pytest.raises(MessageTooLarge, match=rf"over the broker's limit of {LIMIT} bytes.*--max-message-bytes"):
        producer.push_batch(big)
    producer.push_batch(_batch(producer, g, g.samples[0], 4))  # the link goes on: the same sample, small enough
    producer.push_batch(_batch(producer, g, g.samples[1], 4))
    producer.lease_done(g.lease, [])
    time.sleep(0.5)
    assert broker.ask()["samples"]["produced"] == 2


def test_a_batch_over_the_limit_from_another_client_is_logged_and_its_producer_told(broker, producer):
    g = producer.request_lease(1, timeout_s=10)
    big = replace(_batch(producer, g, g.samples[0], 1000), batch_id="big-1")
    push = zmq.Context.instance().socket(zmq.PUSH)  # past the link's own check, as a foreign client would
    push.setsockopt(zmq.LINGER, 0)
    push.connect(producer.welcome.data_in)
    push.send_multipart(codec.encode(big.to_header(producer.run_id), big.tensors))
    ev = broker.wait_event("broker.batch_too_large")
    assert ev["producer"] == producer.peer_id and ev["batch_id"] == "big-1"
    assert ev["bytes"] == 6015 and ev["limit"] == LIMIT
    end = time.monotonic() + 10
    with pytest.raises(Rejected) as got:  # the producer learns why on its next call
        while time.monotonic() < end:
            producer.request_lease(1, timeout_s=0.5)
    assert got.value.code == "too_large" and "big-1" in got.value.reason and "--max-message-bytes" in got.value.reason
    push.close()


def test_a_control_message_over_the_limit_is_refused_at_the_call_and_the_link_goes_on(broker, producer):
    with pytest.raises(MessageTooLarge, match="'heartbeat' is .* bytes, over the control limit"):
        producer.send_control(Heartbeat({"blob": "x" * (2 << 20)}))
    g = producer.request_lease(2, timeout_s=10)  # nothing was lost or refused: the session goes on
    assert len(g.samples) == 2


def test_a_link_whose_control_connection_was_reopened_keeps_its_session(broker, producer):
    # What a network reset does, made on purpose: a message the broker's ZeroMQ refuses
    # closes the connection (queued past send_control's check, straight to the I/O thread).
    producer._control_out.put(header("heartbeat", producer.run_id, stats={"blob": "x" * (2 << 20)}))
    producer._wake()
    time.sleep(1.0)  # closed by the broker, reopened by the DEALER
    g = producer.request_lease(2, timeout_s=10)  # the same identity: the same session, no unknown_peer
    assert len(g.samples) == 2
    st = broker.ask()
    assert [p["peer"] for p in st["peers"] if p["role"] == "producer"] == [producer.peer_id]
    assert not broker.events("broker.peer_rejected"), broker.events("broker.peer_rejected")
