"""What a producer's or consumer's link receives from the broker (welcome and its run
config, grant, reject) is parsed into protocol/messages.py's types, checked as the broker
checks what it receives: a malformed one is a ProtocolError naming the field, never a
value read by key later. Real sockets, a hand-written broker."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq

from dflash.protocol.errors import ProtocolError, Rejected
from dflash.protocol.links import MAX_AUTO_CREDIT, ConsumerLink, ProducerLink
from dflash.protocol.messages import Grant, RunConfig
from dflash.runtime.logs import close_logging, setup_logging

pytestmark = pytest.mark.integration

RUN = "20261130T000000Z-abcd"
RUN_CONFIG = {"epochs": 1, "seed": 7, "lease_size": 4, "max_message_bytes": 1 << 20, "max_credit": 64,
              "dataset": {"n_samples": 10, "fingerprint": None}}


def _h(type_: str, **fields) -> bytes:
    return msgpack.packb({"v": 1, "type": type_, **fields})


def _batch(i: int) -> list[bytes]:
    h = {"v": 1, "type": "batch", "run": RUN, "batch_id": f"p1-{i}", "producer": "p1", "lease": 1, "epoch": 0,
         "samples": [i], "seq_lens": [2], "layer_ids": [1],
         "tensors": [{"name": "input_ids", "dtype": "int32", "shape": [2]},
                     {"name": "loss_mask", "dtype": "uint8", "shape": [2]},
                     {"name": "hidden", "dtype": "bfloat16", "shape": [2, 4]}]}
    return [msgpack.packb(h), bytes(8), b"\x01\x01", bytes(16)]


class HandBroker:
    """Answers a hello with `welcome` (a reject when it is one), each `lease` with `grant`,
    and each `credit` with that many batches on its one data stream (counting the credit)."""

    def __init__(self, welcome: dict, grant: dict | None = None):
        self.ctx = zmq.Context()
        self.ctl = self.ctx.socket(zmq.ROUTER)
        self.port = self.ctl.bind_to_random_port("tcp://127.0.0.1")
        self.pipe = self.ctx.socket(zmq.PUSH)
        self.data = f"tcp://127.0.0.1:{self.pipe.bind_to_random_port('tcp://127.0.0.1')}"
        self.welcome = {"run": RUN, "peer": "x1", "heartbeat_s": 1.0, "timeout_s": 30.0, "data_in": self.data,
                        "data_out": self.data, "run_config": RUN_CONFIG, **welcome}
        self.grant, self.credit, self.sent = grant, 0, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while not self.done.is_set():
            if not self.ctl.poll(50):
                continue
            ident, raw = self.ctl.recv_multipart()
            h = msgpack.unpackb(raw)
            if h["type"] == "hello":
                kind = "reject" if "code" in self.welcome else "welcome"
                fields = {k: v for k, v in self.welcome.items() if kind == "welcome" or k in ("reason", "code")}
                self.ctl.send_multipart([ident, _h(kind, **fields)])
            elif h["type"] == "lease" and self.grant is not None:
                self.ctl.send_multipart([ident, _h("grant", run=RUN, **self.grant)])
            elif h["type"] == "credit":
                self.credit += h["credit"]
                for _ in range(h["credit"]):
                    self.pipe.send_multipart(_batch(self.sent))
                    self.sent += 1

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        for s in (self.ctl, self.pipe):
            s.close(linger=0)
        self.ctx.term()


@pytest.fixture
def logs(tmp_path):
    setup_logging("producer", "t", level="warning")
    yield tmp_path
    close_logging()


def _producer(hb: HandBroker, runs) -> ProducerLink:
    return ProducerLink(hb.address, "t", runs_dir=runs, connect_timeout_s=10, io_threads=1)


def test_the_welcome_and_a_grant_arrive_as_their_types(logs):
    hb = HandBroker({}, grant={"lease": 3, "epoch": 0, "samples": [5, 1], "end": False})
    link = _producer(hb, logs)
    try:
        welcome = link.start()
        assert welcome.run_config == RunConfig.from_header(RUN_CONFIG) and welcome.run_config.dataset.n_samples == 10
        assert welcome.streams(welcome.data_in) == [hb.data]
        grant = link.request_lease(2, timeout_s=10)
        assert isinstance(grant, Grant) and (grant.lease, grant.samples, grant.end, grant.retry_ms) == (3, [5, 1], False,
                                                                                                       None)
    finally:
        link.close("done", flush_timeout_s=1)
        hb.close()


@pytest.mark.parametrize("run_config, words", [
    ({**RUN_CONFIG, "seed": "7"}, "welcome: field 'run_config' (field 'seed' has type str)"),
    ({k: v for k, v in RUN_CONFIG.items() if k != "max_credit"}, "welcome: field 'run_config' (missing field "
                                                                    "'max_credit')"),
    ({**RUN_CONFIG, "dataset": {"n_samples": None}}, "field 'dataset' (field 'n_samples' has type NoneType)"),
    ({**RUN_CONFIG, "layer_ids": [1, "2"]}, "field 'layer_ids' holds an element of type str"),
    ([1, 2], "welcome: field 'run_config' has type list, not a map"),
])
def test_a_malformed_welcome_fails_the_handshake_naming_the_field(logs, run_config, words):
    hb = HandBroker({"run_config": run_config})
    link = _producer(hb, logs)
    try:
        with pytest.raises(ProtocolError, match=r"\(peer broker\)") as got:
            link.start()
        assert words in str(got.value)
    finally:
        hb.close()


def test_a_reject_is_parsed_and_raised_with_its_code(logs):
    hb = HandBroker({"reason": "a live producer is already named t", "code": "duplicate_instance"})
    link = _producer(hb, logs)
    try:
        with pytest.raises(Rejected) as got:
            link.start()
        assert got.value.code == "duplicate_instance" and "already named t" in got.value.reason
    finally:
        hb.close()


def test_a_grant_of_samples_that_are_not_ids_fails_the_link_naming_the_field(logs):
    hb = HandBroker({}, grant={"lease": 3, "epoch": 0, "samples": [5, "six"], "end": False})
    link = _producer(hb, logs)
    try:
        link.start()
        with pytest.raises(ProtocolError, match="grant: field 'samples' holds an element of type str"):
            link.request_lease(2, timeout_s=10)
    finally:
        link.close("done", flush_timeout_s=1)
        hb.close()


def test_the_brokers_max_credit_caps_the_credit_a_consumer_grants(logs):
    """The run config's `max_credit` (PROTOCOL.md 4.1) bounds the consumer's window: small
    batches would grow it to MAX_AUTO_CREDIT otherwise."""
    cap = 3
    assert cap < MAX_AUTO_CREDIT
    hb = HandBroker({"run_config": {**RUN_CONFIG, "max_credit": cap}})
    link = ConsumerLink(hb.address, "t", runs_dir=logs, connect_timeout_s=10, io_threads=2, inbox_bytes=1 << 20)
    try:
        link.start()
        deadline = time.monotonic() + 10
        while hb.credit < cap and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # room for more credit, were the window not capped (nothing is taken out)
        assert hb.credit == cap and link.prefetched() == cap
    finally:
        link.close("done", flush_timeout_s=1)
        hb.close()
