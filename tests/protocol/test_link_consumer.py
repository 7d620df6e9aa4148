"""A consumer's ConsumerLink against a hand-written broker on real sockets: batches may come
over several data streams, each is decoded (and validated) when the caller takes it, and
a malformed one is logged and dropped without losing the batches around it."""

from __future__ import annotations

import threading

import msgpack
import pytest
import zmq
from structlog.testing import capture_logs

from dflash.protocol.links import ConsumerLink
from dflash.runtime.logs import close_logging, setup_logging

pytestmark = pytest.mark.integration

RUN = "20261130T000000Z-abcd"


def _batch(run: str, i: int, bad: bool = False) -> list[bytes]:
    T = 2
    h = {"v": 1, "type": "batch", "run": run, "batch_id": f"p1-{i}", "producer": "p1", "lease": 1, "epoch": 0,
         "samples": [i], "seq_lens": [T], "layer_ids": [1],
         "tensors": [{"name": "input_ids", "dtype": "int32", "shape": [T]},
                     {"name": "loss_mask", "dtype": "uint8", "shape": [T]},
                     {"name": "hidden", "dtype": "bfloat16", "shape": [T, 4]}]}
    hidden = bytes(2 * T * 4)
    return [msgpack.packb(h), (i).to_bytes(4, "little") * T, b"\x01" * T, hidden[:-2] if bad else hidden]


class HandBroker:
    """Answers one hello with a welcome naming `n` data streams (PUSH sockets it binds)."""

    def __init__(self, n: int):
        self.ctx = zmq.Context()
        self.ctl = self.ctx.socket(zmq.ROUTER)
        self.port = self.ctl.bind_to_random_port("tcp://127.0.0.1")
        self.pipes = [self.ctx.socket(zmq.PUSH) for _ in range(n)]
        self.ends = [f"tcp://127.0.0.1:{p.bind_to_random_port('tcp://127.0.0.1')}" for p in self.pipes]
        self.thread = threading.Thread(target=self._welcome, daemon=True)
        self.thread.start()

    def _welcome(self) -> None:
        ident, raw = self.ctl.recv_multipart()
        assert msgpack.unpackb(raw)["type"] == "hello"
        self.ctl.send_multipart([ident, msgpack.packb({
            "v": 1, "type": "welcome", "run": RUN, "peer": "c1", "heartbeat_s": 1.0, "timeout_s": 30.0,
            "data_out": self.ends[0], "data_streams": self.ends,
            "run_config": {"epochs": 1, "seed": 0, "lease_size": 4, "max_message_bytes": 1 << 20, "max_credit": 64}})])

    def close(self) -> None:
        for s in (self.ctl, *self.pipes):
            s.close(linger=0)
        self.ctx.term()


@pytest.mark.parametrize("streams", [1, 2])
def test_batches_from_every_stream_are_taken_and_a_bad_one_is_dropped(tmp_path, streams):
    setup_logging("consumer", "t", level="warning")  # as dflash-consume does: the link binds it to the run
    hb = HandBroker(streams)
    link = ConsumerLink(f"tcp://127.0.0.1:{hb.port}", "t", runs_dir=tmp_path, io_threads=1 + streams)
    with capture_logs() as logs:
        link.start()
        try:
            hb.thread.join(10)
            for i in range(6):  # batch 3 has a hidden frame 2 bytes short of its shape
                hb.pipes[i % streams].send_multipart(_batch(RUN, i, bad=i == 3))
            got = []
            while len(got) < 5:
                msg = link.next_batch(timeout_s=10)
                assert msg is not None, f"got {got} only"
                got.append(msg.samples[0])
                assert int(msg.tensors["input_ids"][0]) == got[-1] and msg.tensors["hidden"].shape == (2, 4)
            masks = [s.getsockopt(zmq.AFFINITY) for s in link._streams]
        finally:
            link.close("done")
            hb.close()
            close_logging()
    assert sorted(got) == [0, 1, 2, 4, 5]
    assert link.stream_batches == ([6] if streams == 1 else [3, 3])
    assert masks == ([0b10] if streams == 1 else [0b010, 0b100])  # a data stream per I/O thread
    bad = [e for e in logs if e["event"] == "link.bad_message"]
    assert len(bad) == 1 and "hidden" in bad[0]["reason"] and bad[0]["peer"] == "broker"
