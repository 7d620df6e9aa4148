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

from broker_fakes import FakeConsumer, FakeProducer, batch_frames
from broker_harness import free_port_block
from dflash.broker import runinfo
from dflash.broker.config import BrokerConfig
from dflash.broker.server import Broker
from dflash.protocol.config import as_dict
from dflash.protocol.run import make_run_dir, new_run_id

MIB = 1 << 20
SEQ, WIDTH = 1024, 32 * 1024  # hidden bf16 [1024, 32768] = 64 MiB


def _broker(tmp_path, io_threads: int = 1) -> Broker:
    port = free_port_block(4)
    cfg = BrokerConfig(bind="127.0.0.1", port=port, data_in_port=port + 1, data_out_ports=(port + 2, port + 3),
                       runs_dir=str(tmp_path), timeout_s=30.0, drain_s=0.0,  # SIGTERM: no wait for peers
                       io_threads=io_threads)
    run_id = new_run_id()
    run_dir = make_run_dir(run_id, tmp_path)
    b = Broker(cfg, run_id, run_dir, "127.0.0.1")
    runinfo.start(run_dir, run_id, as_dict(cfg), b.endpoints, cfg.instance)  # as dflash-broker does
    return b


@pytest.mark.parametrize("io_threads", [1, 2, 4])
def test_a_64mib_batch_is_relayed_without_a_python_copy(tmp_path, io_threads):
    with capture_logs():
        b = _broker(tmp_path, io_threads)
        loop = threading.Thread(target=b.serve, daemon=True)
        loop.start()
        try:
            ctl = f"tcp://127.0.0.1:{b.cfg.port}"
            cons = FakeConsumer(ctl, "zc-cons")
            prod = FakeProducer(ctl, "zc-prod", n_samples=1)
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
            pipe = b.peers.by_id[cons.peer].pipe if cons.peer in b.peers.by_id else None
            pipe_affinity = pipe.getsockopt(zmq.AFFINITY) if pipe is not None else None
            in_affinity = b.data_in.getsockopt(zmq.AFFINITY)
            control_affinity = b.control.getsockopt(zmq.AFFINITY)
            b.close()
        assert got is not None, "the batch never reached the consumer"
        relayed = b.peers.by_id[cons.peer].in_flight[f"{prod.peer}-1"].frames
        prod.close()
        cons.close()

    assert got[3].buffer == frames[3]  # the payload arrived intact
    assert all(isinstance(f, zmq.Frame) for f in relayed)  # what it sent is what it received
    assert relayed[3].buffer.nbytes == 64 * MIB
    assert peak < 4 * MIB, f"Python allocated a peak of {peak / MIB:.1f} MiB while relaying a 64 MiB batch"
    # Two I/O threads: batches in on the first, the consumer's pipe on the second (the
    # relay's two copies on two cores); four: batches in on the first two, pipes on the
    # other two, control on the first; one thread: no mask.
    want = {1: (0, 0, 0), 2: (1, 1, 0b10), 4: (1, 0b0011, 0b1100)}[io_threads]
    assert (control_affinity, in_affinity, pipe_affinity) == want
