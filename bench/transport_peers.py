"""The processes bench/transport.py and bench/scaling.py start; each prints one JSON line.

    direct-recv  PULL bound on loopback, codec.decode every message (as a consumer does)
    direct-send  PUSH connected to it, codec.encode'd batches, copy=False (as a producer does)
    produce      a real producer's client (protocol.links.ProducerLink): lease, push, done
    consume      a real consumer's client (ConsumerLink): credit, take, ack, commit at stop

Receivers time from the first message after `--warm` to the last, so connection set-up
and first-touch page faults are not in the rate, and report that window (perf_counter:
the same clock in every process) so the caller can read each process's CPU inside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import zmq

from common import HIDDEN, LAYER_IDS, PROFILE_DIR, batch_tensors, payload_bytes
from dflash.protocol import codec
from dflash.protocol.batch import Batch
from dflash.protocol.fields import header
from dflash.runtime.alloc import reuse_freed_memory
from dflash.protocol.sockets import SocketOpts, auto_io_threads, make_socket


def _rate(times: list[float], sizes: list[int], warm: int) -> dict:
    """Throughput over messages warm+1..end (intervals after the warm-up message)."""
    n = len(times) - 1 - warm
    dt = times[-1] - times[warm] if n > 0 else float("nan")
    nbytes = sum(sizes[warm + 1:])
    return {"messages": n, "seconds": dt, "gb_per_s": nbytes / dt / 1e9, "msgs_per_s": n / dt,
            "t0": times[warm] if n > 0 else None, "t1": times[-1] if n > 0 else None}


def _fields(i: int, T: int) -> dict:
    return dict(lease=0, epoch=0, samples=[i], seq_lens=[T], layer_ids=LAYER_IDS)


def _batch(t: dict, fresh: bool) -> dict:
    """The batch to send: `t` itself, or (--fresh) a new copy written just now, as a
    producer's batch is: new memory each time, written by another core than the one that
    sends it. Sending one buffer over and over sends it from the sender's cache."""
    return {k: v.clone() for k, v in t.items()} if fresh else t


def direct_recv(a) -> dict:
    reuse_freed_memory()  # as a consumer does (dflash-consume), before any ZeroMQ thread
    ctx = zmq.Context(io_threads=a.io_threads or auto_io_threads())
    sock = make_socket(ctx, zmq.PULL, f"tcp://127.0.0.1:{a.port}", bind=True,
                       opts=SocketOpts(rcvhwm=a.rcvhwm, rcvbuf=a.rcvbuf, maxmsgsize=1 << 30))
    times, sizes = [], []
    for _ in range(a.n + a.warm):
        msg = codec.recv(sock, allowed=frozenset({"batch"}))
        times.append(time.perf_counter())
        sizes.append(msg.payload_bytes())
        del msg  # the frames go back to ZeroMQ's allocator now, as a consumer's would after its step
    out = _rate(times, sizes, a.warm)
    sock.close()
    ctx.term()
    return out


def direct_send(a) -> dict:
    ctx = zmq.Context(io_threads=a.io_threads or auto_io_threads())
    sock = make_socket(ctx, zmq.PUSH, f"tcp://127.0.0.1:{a.port}", bind=False,
                       opts=SocketOpts(sndhwm=a.sndhwm, sndbuf=a.sndbuf, linger_ms=-1))
    t = batch_tensors(a.mib)
    T = t["input_ids"].numel()
    for i in range(a.n + a.warm):
        h = header("batch", "bench", batch_id=f"p1-{i}", producer="p1", **_fields(i, T))
        codec.send(sock, h, _batch(t, a.fresh))
    sock.close()  # linger -1: returns once everything is on the wire
    ctx.term()
    return {"payload_bytes": payload_bytes(t)}


def produce(a) -> dict:
    from dflash.protocol.links import ProducerLink

    t = batch_tensors(a.mib)
    T = t["input_ids"].numel()
    cfg = {"target": "bench", "layer_ids": LAYER_IDS, "hidden_size": HIDDEN,
           "dataset": {"n_samples": a.n_samples, "fingerprint": "bench"}}
    link = ProducerLink(a.broker, a.instance, config=cfg, runs_dir=a.runs_dir, io_threads=a.io_threads)
    link.start()
    sent = 0
    while not link.stopped.is_set():
        g = link.request_lease(a.lease, timeout_s=60)
        if not g.samples:
            if g.end:
                break
            time.sleep((g.retry_ms or 100) / 1000)
            continue
        for s in g.samples:
            fields = {**_fields(s, T), "lease": g.lease, "epoch": g.epoch}
            link.push_batch(Batch(f"{link.peer_id}-{sent}", link.peer_id, **fields, tensors=_batch(t, a.fresh)))
            sent += 1
        link.lease_done(g.lease, [])
    link.close("done")
    return {"sent": sent, "payload_bytes": payload_bytes(t)}


def consume(a) -> dict:
    from dflash.protocol.links import ConsumerLink

    reuse_freed_memory()  # as dflash-consume does, before any ZeroMQ thread
    link = ConsumerLink(a.broker, a.instance, runs_dir=a.runs_dir, inbox_batches=a.credit,
                        inbox_bytes=a.inbox_bytes or None, io_threads=a.io_threads)
    link.start()
    times, sizes, step = [], [], 0
    while True:
        msg = link.next_batch(timeout_s=0.5)
        if msg is None:
            if link.stopped.is_set():
                break
            continue
        times.append(time.perf_counter())
        sizes.append(payload_bytes(msg.tensors))
        step += 1
        link.ack([msg.batch_id], step)  # one "optimizer step" per batch
        del msg
    link.commit(step, f"bench/step-{step}")
    link.close("done")
    out = {**_rate(times, sizes, a.warm), "received": len(times)}
    if a.times:  # every receipt time, for an aggregate over several consumers (bench/scaling.py)
        out["times"], out["payload_bytes"] = times, sizes[0] if sizes else 0
    return out


def profiled(role: str):
    """With DFLASH_BENCH_PROFILE=DIR: cProfile this process's main thread and its link's
    I/O thread, each to DIR/<role>-<pid>-<thread>.prof at exit (bench/profile_top.py)."""
    import atexit
    import cProfile
    import os

    from dflash.protocol.peer import PeerLink

    where = PROFILE_DIR
    if not where:
        return
    io_loop = PeerLink._io_loop

    def io_loop_profiled(self):
        prof = cProfile.Profile()
        try:
            prof.runcall(io_loop, self)
        finally:
            prof.dump_stats(f"{where}/{role}-{os.getpid()}-io.prof")

    PeerLink._io_loop = io_loop_profiled
    main_prof = cProfile.Profile()
    main_prof.enable()
    atexit.register(lambda: (main_prof.disable(), main_prof.dump_stats(f"{where}/{role}-{os.getpid()}-main.prof")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["direct-recv", "direct-send", "produce", "consume"])
    ap.add_argument("--port", type=int)
    ap.add_argument("--broker")
    ap.add_argument("--runs-dir", default="runs")
    ap.add_argument("--instance", default="bench")
    ap.add_argument("--mib", type=float, default=16)
    ap.add_argument("--n", type=int, default=10, help="timed messages (direct)")
    ap.add_argument("--n-samples", type=int, default=10, help="dataset size = batches (produce)")
    ap.add_argument("--lease", type=int, default=256)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--times", action="store_true", help="consume: report every receipt time")
    ap.add_argument("--fresh", action="store_true", help="senders: a new copy of the batch for every message")
    ap.add_argument("--credit", type=int, default=2, help="consumer inbox: at least this many batches")
    ap.add_argument("--inbox-bytes", type=int, default=0, help="consumer inbox bound in bytes (0: --credit batches)")
    ap.add_argument("--io-threads", type=int, default=0, help="ZeroMQ I/O threads (0: the links' auto)")
    ap.add_argument("--sndhwm", type=int, default=1, help="ProducerLink's PUSH uses 1")
    ap.add_argument("--rcvhwm", type=int, default=3, help="ConsumerLink's PULL uses credit + 1")
    ap.add_argument("--sndbuf", type=int, default=-1)
    ap.add_argument("--rcvbuf", type=int, default=-1)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # --fresh copies on one core: a pool of spinning workers measured 20 CPU s/GB
    from dflash.runtime.logs import setup_logging

    setup_logging(a.role, a.instance, level="warning", stream=sys.stderr)  # stdout: the result only
    profiled(a.role)
    fn = {"direct-recv": direct_recv, "direct-send": direct_send, "produce": produce, "consume": consume}[a.role]
    print("RESULT " + json.dumps(fn(a)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
