"""The broker relays a large batch without a Python-level copy of its tensor frames.

The broker runs in this process (its own loop, on a thread) so tracemalloc sees every
Python allocation it makes; the producer and consumer are the hand-written wire fakes on
real loopback sockets. A 64 MiB batch goes producer -> broker -> consumer. If the broker
turned a frame into bytes (`frame.bytes`, `bytes(buf)`, a numpy copy, `copy=True` on
recv or send), the traced peak would be at least 64 MiB; the frames it keeps for
redelivery must also still be the zmq.Frame objects it received.
"""

from __future__ import annotations

import threading
import time
import tracemalloc

import pytest
import zmq
from structlog.testing import capture_logs

from tests.harness.fakes import FakeConsumer, FakeProducer, batch_frames
from dflash.protocol.sockets import free_port_block
from dflash.broker import runinfo
from dflash.broker.config import BrokerConfig
from dflash.broker.server import Broker
from dflash.runtime.command_line import as_dict
from dflash.runtime.run import make_run_dir, new_run_id

pytestmark = pytest.mark.integration

MIB = 1 << 20
SEQ, WIDTH = 1024, 32 * 1024  # hidden bf16 [1024, 32768] = 64 MiB


def _broker(tmp_path, io_threads: int = 1, pipes: int = 2, data_streams: int = 0) -> Broker:
    port = free_port_block(2 + pipes)
    cfg = BrokerConfig(bind="127.0.0.1", port=port, data_in_port=port + 1, data_out_ports=(port + 2, port + 1 + pipes),
                       runs_dir=str(tmp_path), timeout_s=30.0, drain_s=0.0,  # SIGTERM: no wait for peers
                       io_threads=io_threads, data_streams=data_streams)
    run_id = new_run_id()
    run_dir = make_run_dir(run_id, tmp_path)
    b = Broker(cfg, run_id, run_dir, "127.0.0.1")
    runinfo.start(run_dir, run_id, as_dict(cfg), b.endpoints, cfg.instance)  # as dflash-broker does
    return b


@pytest.mark.parametrize("io_threads", [1, 2, 5])
def test_a_64mib_batch_is_relayed_without_a_python_copy(tmp_path, io_threads):
    with capture_logs():
        b = _broker(tmp_path, io_threads)
        loop = threading.Thread(target=b.serve, daemon=True)
        loop.start()
        try:
            ctl = f"tcp://127.0.0.1:{b.cfg.port}"
            cons = FakeConsumer(ctl, "zc-cons")
            prod = FakeProducer(ctl, "zc-prod", n_samples=1, width=WIDTH)
            cons.send("credit", credit=1)
            prod.send("lease", want=1)
            g = prod.wait_for({"grant"}, 10)
            frames = batch_frames(prod.run, prod.peer, f"{prod.peer}-1", g["lease"], g["epoch"], g["samples"],
                                  seq_len=SEQ, width=WIDTH)
            assert len(frames[3]) == 64 * MIB
            frames[3] = bytes(range(256)) * (64 * MIB // 256)  # content to check at the far end

            tracemalloc.start()  # from here on, every Python allocation of every thread counts
            prod.data.send_multipart(frames, copy=False)
            got = None
            end = time.monotonic() + 30
            while got is None and time.monotonic() < end:
                prod.pump()
                cons.pump()
                if cons.data.poll(20):
                    got = cons.data.recv_multipart(copy=False)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            b.signal = "SIGTERM"  # acted on by the loop itself: it stops, then we read its state
            loop.join(10)
            live = b.core.sessions.table.by_id
            pipes = [b.pipes[port] for port in live[cons.peer].pipes.ports] if cons.peer in live else []
            pipe_affinity = [pipe.getsockopt(zmq.AFFINITY) for pipe in pipes]
            in_affinity = b.data_in.getsockopt(zmq.AFFINITY)
            control_affinity = b.control.getsockopt(zmq.AFFINITY)
            relayed = b.frames.get(f"{prod.peer}-1", [])  # the frames the server keeps for redelivery
            b.close()
        assert got is not None, "the batch never reached the consumer"
        prod.close()
        cons.close()

    assert got[3].buffer == frames[3]  # the payload arrived intact
    assert all(isinstance(f, zmq.Frame) for f in relayed)  # what it sent is what it received
    assert relayed[3].buffer.nbytes == 64 * MIB
    assert peak < 4 * MIB, f"Python allocated a peak of {peak / MIB:.1f} MiB while relaying a 64 MiB batch"
    # Two I/O threads: control and batches in on the first, the consumer's pipe on the
    # second (the relay's two copies on two cores); five: control on the first, batches in
    # on the next two, the consumer's two data streams one on each of the last two (this
    # fake consumer connects to the first only: every batch takes that one); one thread:
    # no mask.
    want = {1: (0, 0, [0]), 2: (1, 1, [0b10]), 5: (1, 0b00110, [0b01000, 0b10000])}[io_threads]
    assert (control_affinity, in_affinity, pipe_affinity) == want


@pytest.mark.parametrize("data_streams", [1, 0])
def test_consumer_pipes_take_the_pipe_threads_in_turn(tmp_path, data_streams):
    """Five I/O threads: the consumers' data streams go to the fourth and fifth in turn
    (libzmq, left to choose within the mask, put every connection on one of them). One
    stream each: consumer by consumer; auto (two each): one stream on each thread."""
    with capture_logs():
        b = _broker(tmp_path, io_threads=5, pipes=6, data_streams=data_streams)
        loop = threading.Thread(target=b.serve, daemon=True)
        loop.start()
        consumers = []
        try:
            ctl = f"tcp://127.0.0.1:{b.cfg.port}"
            consumers = [FakeConsumer(ctl, f"pt-{i}") for i in range(3)]
        finally:
            b.signal = "SIGTERM"
            loop.join(10)
            masks = [[b.pipes[port].getsockopt(zmq.AFFINITY) for port in b.core.sessions.table.by_id[c.peer].pipes.ports]
                     for c in consumers]
            b.close()
            for c in consumers:
                c.close()
    t4, t5 = 0b01000, 0b10000
    assert masks == ([[t4], [t5], [t4]] if data_streams == 1 else [[t4, t5]] * 3)
