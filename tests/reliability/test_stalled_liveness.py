"""A stalled loop is not a silent peer (found by the soak, tests/reliability/soak.py, on a
loaded 2-core host): a consumer's I/O thread, starved for about 3 s, woke with the result
of a poll taken before the stall, found no broker message in it and exited "broker silent
for 3.2s: broker lost" while the broker's heartbeats were waiting in its socket. The broker
judges its peers the same way after its own loop stalls between a poll and its timers.
Both now look at the control socket again before calling the other side lost.

The stalls themselves came mostly from the garbage collector: a full pass over the
hundreds of thousands of objects that importing torch leaves holds the GIL, for seconds on
a loaded host, and a checkpoint's allocations set one off. The broker's loop, a peer's link
and the training loop freeze what their setup left alive (runtime/gcpause.py).
"""

from __future__ import annotations

import gc
import threading
import time

import zmq
from structlog.testing import capture_logs

import pytest

from tests.harness.fakes import FakeProducer
from dflash.broker import runinfo
from dflash.broker.config import BrokerConfig
from dflash.broker.server import Broker
from dflash.protocol.links import ProducerLink
from dflash.protocol.peer import broker_silent
from dflash.protocol.sockets import free_port_block
from dflash.runtime.command_line import as_dict
from dflash.runtime.logs import close_logging, setup_logging
from dflash.runtime.run import make_run_dir, new_run_id

pytestmark = pytest.mark.integration

TIMEOUT_S = 1.0


def test_a_peer_that_wakes_late_reads_the_waiting_heartbeat_before_calling_the_broker_lost():
    ctx = zmq.Context.instance()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"hello")
        assert router.poll(5000)
        identity, _ = router.recv_multipart()
        router.send_multipart([identity, b"heartbeat"])
        assert dealer.poll(5000)  # it is waiting in the peer's socket (poll reads nothing)
        now = time.monotonic()
        stale = now - TIMEOUT_S - 1  # the last poll that saw a message, before the stall
        assert not broker_silent(dealer, now, stale, TIMEOUT_S)
        assert dealer.recv() == b"heartbeat"  # the I/O loop's next turn reads it
        assert broker_silent(dealer, now, stale, TIMEOUT_S)  # nothing waiting: lost indeed
        assert not broker_silent(dealer, now, now - TIMEOUT_S + 1, TIMEOUT_S)  # within the timeout
    finally:
        router.close(0)
        dealer.close(0)


def _broker(tmp_path, **kw) -> Broker:
    port = free_port_block(3)
    cfg = BrokerConfig(bind="127.0.0.1", port=port, data_in_port=port + 1, data_out_ports=(port + 2, port + 2),
                       runs_dir=str(tmp_path), **{"timeout_s": TIMEOUT_S, "heartbeat_s": 0.25, "drain_s": 0.0, **kw})
    run_id = new_run_id()
    run_dir = make_run_dir(run_id, tmp_path)
    b = Broker(cfg, run_id, run_dir, "127.0.0.1")
    runinfo.start(run_dir, run_id, as_dict(cfg), b.endpoints, cfg.instance)
    return b


def _pump(b: Broker) -> None:
    """One read of the broker's control socket, as its loop does after a poll."""
    b._drain(b.control, b._control)


def test_a_broker_that_stalled_reads_what_its_peers_sent_before_dropping_them(tmp_path):
    with capture_logs() as logs:
        b = _broker(tmp_path)  # no loop: this test turns it by hand
        try:
            made: list = []
            t = threading.Thread(target=lambda: made.append(FakeProducer(f"tcp://127.0.0.1:{b.cfg.port}", "st-p")))
            t.start()
            while t.is_alive():  # the handshake: the broker reads the hello and welcomes
                if b.control.poll(50):
                    _pump(b)
            (prod,) = made
            live = lambda: {p.id for p in b.core.sessions.table.live()}  # noqa: E731
            assert prod.peer in live()
            # The broker's loop stalls (not turned) past the timeout; the producer talks
            # meanwhile, and its heartbeat waits unread when the loop wakes to its timers.
            time.sleep(TIMEOUT_S + 0.3)
            prod.send("heartbeat", stats={})
            assert b.control.poll(5000)  # waiting, unread
            b.tick(time.monotonic())
            assert prod.peer in live(), [e for e in logs if e["event"] == "broker.peer_lost"]
            # A peer with nothing waiting after the timeout is dropped at the same check.
            time.sleep(TIMEOUT_S + 0.3)
            b.tick(time.monotonic())
            assert prod.peer not in live()
            assert [e["peer"] for e in logs if e["event"] == "broker.peer_lost"] == [prod.peer]
            prod.close()
        finally:
            b.close()


def test_the_broker_loop_and_a_peer_link_freeze_what_setup_left_alive(tmp_path):
    gc.unfreeze()
    with capture_logs():
        b = _broker(tmp_path, timeout_s=30.0, num_samples=8)  # a producer may join without a dataset
        loop = threading.Thread(target=b.serve, daemon=True)
        link = None
        try:
            assert gc.get_freeze_count() == 0
            loop.start()
            end = time.monotonic() + 30
            while gc.get_freeze_count() == 0 and time.monotonic() < end:
                time.sleep(0.05)
            assert gc.get_freeze_count() > 0, "the broker's loop started without freezing its setup"
            gc.unfreeze()
            setup_logging("producer", "gc-p", level="warning")
            link = ProducerLink(f"tcp://127.0.0.1:{b.cfg.port}", "gc-p", runs_dir=tmp_path,
                                connect_timeout_s=30)
            link.start()
            assert gc.get_freeze_count() > 0, "the link started its I/O thread without freezing the setup"
        finally:
            if link is not None:
                link.close("done", flush_timeout_s=2)
            close_logging()
            b.signal = "SIGTERM"
            loop.join(20)
            b.close()
            gc.unfreeze()  # the rest of this pytest process collects as usual
