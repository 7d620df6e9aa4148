"""The broker's core holds no ZeroMQ object; the server owns every socket and frame (issue 37).

A real broker (its loop on a thread, real loopback sockets) serves a hand-written producer
and consumer through a session: hello, a lease, two batches relayed, one acked, stop and
close. At each point every object reachable from the core (attributes, containers, bound
methods, closures; not modules or classes) is walked, and none may be a ZeroMQ socket,
context, frame or a buffer over one. The consumer's pipes are the server's, by port, and
the frames of the batch still held are the server's, by batch ID, until close. The same
walk over a core driven in-process by the core rig finds none of the rig's stand-ins.
"""

from __future__ import annotations

import gc
import threading
import types
from collections import Counter

import pytest
import zmq
from structlog.testing import capture_logs

from dflash.broker import runinfo
from dflash.broker.actions import ClosePipes
from dflash.broker.config import BrokerConfig
from dflash.broker.server import Broker
from dflash.protocol.sockets import free_port_block
from dflash.runtime.command_line import as_dict
from dflash.runtime.run import make_run_dir, new_run_id
from tests.harness.core_rig import Pipe, Rig
from tests.harness.fakes import FakeConsumer, FakeProducer, batch_frames
from tests.harness.wait import wait_until

pytestmark = pytest.mark.integration

# Followed no further: what a module or class holds is not the core's state.
NOT_STATE = (types.ModuleType, type, types.CodeType)


def is_zmq(obj) -> bool:
    return type(obj).__module__.split(".")[0] == "zmq"


def referents(obj) -> list[tuple[str, object]]:
    """What `obj` holds, each with a name for the path: attributes, items, and what the
    garbage collector sees (bound methods, cells, buffers); a function's closure and
    defaults but not its module globals. Containers are copied in one C call first (the
    broker's loop runs meanwhile, on its own thread)."""
    if isinstance(obj, dict):
        items = list(obj.items())
        return [(f"[{k!r}]", v) for k, v in items] + [("<key>", k) for k, _ in items]
    if isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
        return [(f"[{i}]", v) for i, v in enumerate(list(obj))]
    if isinstance(obj, types.FunctionType):
        cells = [(f".<closure {i}>", c.cell_contents) for i, c in enumerate(obj.__closure__ or ())
                 if c.cell_contents is not None]
        return cells + [(".__defaults__", obj.__defaults__), (".__kwdefaults__", obj.__kwdefaults__)]
    if isinstance(obj, types.MethodType):
        return [(".__self__", obj.__self__), (".__func__", obj.__func__)]
    if isinstance(obj, memoryview):
        return [(".obj", obj.obj)]
    attrs = getattr(obj, "__dict__", None)
    out = [(f".{k}", v) for k, v in list(attrs.items())] if isinstance(attrs, dict) else []
    base = getattr(obj, "base", None)  # a numpy view keeps its buffer's owner alive
    if base is not None and type(obj).__name__ == "ndarray":
        out.append((".base", base))
    return out + [(".<ref>", r) for r in gc.get_referents(obj) if r is not attrs]


def reachable(root, wanted) -> tuple[list[str], Counter]:
    """The path to every object reachable from `root` for which `wanted(obj)` holds, and
    how many of each type the walk saw (so a test can check it reached what it meant to)."""
    seen, found, kinds = {id(root)}, [], Counter()
    todo = [("core", root)]
    while todo:
        path, obj = todo.pop()
        kinds[type(obj).__name__] += 1
        if wanted(obj):
            found.append(f"{path}: {type(obj).__module__}.{type(obj).__qualname__}")
            continue
        for name, ref in referents(obj):
            if ref is None or id(ref) in seen or isinstance(ref, NOT_STATE):
                continue
            seen.add(id(ref))
            todo.append((path + name, ref))
    return found, kinds


def zmq_reachable(root) -> tuple[list[str], Counter]:
    """Every ZeroMQ object reachable from `root` (reachable())."""
    return reachable(root, is_zmq)


def test_the_walk_finds_a_socket_behind_a_bound_method_and_a_frame_behind_a_buffer():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    try:
        class Server:
            def __init__(self):
                self.pipes = {7000: sock}

            def bind(self, port):
                return self.pipes[port]

        class Core:
            def __init__(self, bind):
                self.bind = bind
                self.view = memoryview(zmq.Frame(b"abc").buffer)

        found, _ = zmq_reachable(Core(Server().bind))
        assert sorted(p.split(":")[0] for p in found) == ["core.bind.__self__.pipes[7000]", "core.view.obj"]
    finally:
        sock.close(linger=0)
        ctx.term()


def test_in_process_the_core_holds_none_of_what_its_server_holds(tmp_path):
    """Driven by the core rig (tests/harness/core_rig.py), which carries out the actions as
    the server does: its stand-ins for pipes and the frames it keeps are never the core's."""
    r = Rig(tmp_path, streams=2)
    p, g = r.produce()
    _, g2 = r.produce()
    r.consumer(credit=1)
    r.dispatch()
    r.control(b"cons", "ack", batch_ids=[f"{p}-{g['lease']}-{g['samples'][0]}"], step=1)
    r.control(b"cons", "credit", credit=1)
    assert [x.batch_id for x in r.dispatch()] == [f"{p}-{g2['lease']}-{g2['samples'][0]}"]
    held = {id(f) for f in r.frames.values()}
    assert len(r.pipes) == 2 and len(held) == 1
    found, kinds = reachable(r.core, lambda x: isinstance(x, Pipe) or id(x) in held)
    assert not found, "the core holds what the server holds:\n  " + "\n  ".join(found)
    assert kinds["ConsumerSession"] == 1 and kinds["Pipes"] == 1 and kinds["Queued"] == 2
    ports = tuple(r.peer(b"cons").pipes.ports)
    assert [a.ports for a in r.close() if isinstance(a, ClosePipes)] == [ports] and r.pipes == {}


def _broker(tmp_path) -> Broker:
    port = free_port_block(4)
    cfg = BrokerConfig(bind="127.0.0.1", port=port, data_in_port=port + 1, data_out_ports=(port + 2, port + 3),
                       runs_dir=str(tmp_path), timeout_s=30.0, drain_s=0.0, io_threads=1)
    run_id = new_run_id()
    run_dir = make_run_dir(run_id, tmp_path)
    b = Broker(cfg, run_id, run_dir, "127.0.0.1")
    runinfo.start(run_dir, run_id, as_dict(cfg), b.endpoints, cfg.instance)  # as dflash-broker does
    return b


def test_no_zmq_object_is_reachable_from_the_core_through_a_session(tmp_path):
    with capture_logs():
        b = _broker(tmp_path)
        core = b.core
        loop = threading.Thread(target=b.serve, daemon=True)
        loop.start()
        cons = prod = None
        try:
            ctl = f"tcp://127.0.0.1:{b.cfg.port}"
            cons = FakeConsumer(ctl, "own-cons")
            prod = FakeProducer(ctl, "own-prod", n_samples=4)
            cons.send("credit", credit=2)
            prod.send("lease", want=4)
            g = prod.wait_for({"grant"}, 10)
            ids = [f"{prod.peer}-1", f"{prod.peer}-2"]
            for bid, samples in zip(ids, (g["samples"][:2], g["samples"][2:])):
                prod.push(batch_frames(prod.run, prod.peer, bid, g["lease"], g["epoch"], samples))
            got = []
            while len(got) < 2:
                prod.pump()
                cons.pump()
                if cons.data.poll(20):
                    got.append(cons.data.recv_multipart())
                assert loop.is_alive()
            cons.send("ack", batch_ids=[ids[0]], step=1)
            consumer = core.sessions.table.by_id[cons.peer]
            wait_until(lambda: list(consumer.in_flight) == [ids[1]], 10, "the broker to take the ack")

            found, kinds = zmq_reachable(core)
            assert not found, "the core reaches ZeroMQ objects:\n  " + "\n  ".join(found)
            # the walk reached the session, its pipes and the batches it holds
            assert kinds["ConsumerSession"] == 1 and kinds["ProducerSession"] == 1 and kinds["Queued"] == 2
            # ...while the server holds the consumer's pipes by port, the held batch's frames by ID
            assert sorted(b.pipes) == list(consumer.pipes.ports) == [b.cfg.data_out_ports[0]]
            assert all(isinstance(s, zmq.Socket) for s in b.pipes.values())
            assert list(b.frames) == [ids[1]] and all(isinstance(f, zmq.Frame) for f in b.frames[ids[1]])
        finally:
            b.signal = "SIGTERM"
            loop.join(10)
        assert not zmq_reachable(core)[0]
        b.close()
        found, _ = zmq_reachable(core)
        assert not found, "after close, the core reaches ZeroMQ objects:\n  " + "\n  ".join(found)
        assert b.pipes == {} and b.frames == {}  # closed and let go, by their owner
        for peer in (cons, prod):
            if peer is not None:
                peer.close()
