"""Hand-written fake peers for broker tests, written from docs/PROTOCOL.md alone with
zmq + msgpack (no torch, no dflash codec): if the broker and these disagree, one of us
misread the spec. Usable in threads (tests) or as processes:

    python -m tests.harness.fakes producer --broker tcp://127.0.0.1:5555 --runs-dir R
    python -m tests.harness.fakes consumer --broker ... --train-s 0.01

Processes log through dflash.runtime.logs (JSON, into the run folder) and exit 0 after
`stop` / `grant end`, 3 when rejected, 4 when the broker goes silent.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from array import array

import msgpack
import zmq

V = 1


def pack(type_: str, run: str | None = None, **fields) -> bytes:
    h = {"v": V, "type": type_, **fields}
    if run is not None:
        h["run"] = run
    return msgpack.packb(h, use_bin_type=True)


def batch_frames(run: str, producer: str, batch_id: str, lease: int, epoch: int, samples: list[int],
                 seq_len: int = 4, layer_ids=(1, 2), width: int = 8) -> list[bytes]:
    """A valid batch whose input_ids repeat each sample ID (so content can be checked)."""
    T = seq_len * len(samples)
    ids = array("i", [s for s in samples for _ in range(seq_len)]).tobytes()
    h = {"v": V, "type": "batch", "run": run, "batch_id": batch_id, "producer": producer, "lease": lease,
         "epoch": epoch, "samples": samples, "seq_lens": [seq_len] * len(samples), "layer_ids": list(layer_ids),
         "tensors": [{"name": "input_ids", "dtype": "int32", "shape": [T]},
                     {"name": "loss_mask", "dtype": "uint8", "shape": [T]},
                     {"name": "hidden", "dtype": "bfloat16", "shape": [T, width]}]}
    return [msgpack.packb(h), ids, bytes(T), bytes(2 * T * width)]


class Rejected(Exception):
    pass


class BrokerGone(Exception):
    pass


class FakePeer:
    """hello/welcome, heartbeats, and reading control messages, shared by both fakes."""

    role = "?"

    def __init__(self, broker: str, instance: str, *, run: str | None = None, config: dict | None = None,
                 log=None, connect_timeout_s: float = 10.0, gpu: int | None = None, pid: int | None = None):
        self.ctx = zmq.Context.instance()
        self.instance, self.log = instance, log or (lambda event, **kw: None)
        self.ctl = self.ctx.socket(zmq.DEALER)
        self.ctl.setsockopt(zmq.LINGER, 500)
        self.ctl.connect(broker)
        hello = {"role": self.role, "instance": instance, "host": socket.gethostname(), "pid": pid or os.getpid(),
                 "gpu": gpu, "config": config or {}}
        if run is not None:
            hello["run"] = run
        self.ctl.send(pack("hello", **hello))
        w = self.wait_for({"welcome"}, connect_timeout_s)
        self.welcome = w
        self.run, self.peer = w["run"], w["peer"]
        self.hb_s, self.timeout_s = w["heartbeat_s"], w["timeout_s"]
        self.next_hb = time.monotonic() + self.hb_s
        self.heard = time.monotonic()
        self.stopped: str | None = None

    def send(self, type_: str, **fields) -> None:
        self.ctl.send(pack(type_, self.run, **fields))

    def wait_for(self, types: set, timeout_s: float) -> dict:
        """Next control message of one of `types` (others go to on_control). Raises."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.ctl.poll(50):
                h = msgpack.unpackb(self.ctl.recv_multipart()[0])
                if h["type"] == "reject":
                    raise Rejected(f"{h['code']}: {h['reason']}")
                if h["type"] in types:
                    return h
                self.on_control(h)
            self.beat()
        raise BrokerGone(f"no {sorted(types)} within {timeout_s}s")

    def on_control(self, h: dict) -> None:
        self.heard = time.monotonic()
        if h["type"] == "stop":
            self.stopped = h["reason"]

    def pump(self) -> None:
        """Read pending control messages and beat; raise BrokerGone after timeout_s of silence."""
        while self.ctl.poll(0):
            h = msgpack.unpackb(self.ctl.recv_multipart()[0])
            if h["type"] == "reject":
                raise Rejected(f"{h['code']}: {h['reason']}")
            self.on_control(h)
        self.beat()
        if time.monotonic() - self.heard > self.timeout_s:
            raise BrokerGone("broker silent")

    def beat(self) -> None:
        if hasattr(self, "run") and time.monotonic() >= self.next_hb:
            self.send("heartbeat", stats=self.stats())
            self.next_hb = time.monotonic() + self.hb_s

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        for s in (getattr(self, "data", None), self.ctl):
            if s is not None:
                s.close()


class FakeProducer(FakePeer):
    role = "producer"

    def __init__(self, broker, instance, *, n_samples: int = 64, per_batch: int = 2, want: int = 8,
                 delay_s: float = 0.0, fingerprint: str = "fp", width: int = 8, name_connection: bool = False, **kw):
        # its batches' hidden width is len(layer_ids) x hidden_size, as the broker checks (PROTOCOL.md 4.4)
        cfg = {"target": "fake", "layer_ids": [1, 2], "hidden_size": width // 2,
               "dataset": {"n_samples": n_samples, "fingerprint": fingerprint}}
        super().__init__(broker, instance, config=kw.pop("config", cfg), **kw)
        self.per_batch, self.want, self.delay_s, self.width = per_batch, want, delay_s, width
        self.data = self.ctx.socket(zmq.PUSH)
        self.data.setsockopt(zmq.SNDHWM, 2)
        self.data.setsockopt(zmq.LINGER, 2000)
        if name_connection:  # ZMTP metadata naming this producer (PROTOCOL.md 1)
            self.data.setsockopt(zmq.METADATA, f"X-Peer:{self.peer}".encode())
            self.data.setsockopt(zmq.METADATA, f"X-Instance:{instance}".encode())
        self.data.connect(self.welcome["data_in"])
        self.seq = 0
        self.sent: list[str] = []

    def push(self, frames: list) -> None:
        # Backpressure blocks the PUSH; keep beating while it does, as a real peer's
        # I/O thread would.
        while True:
            self.pump()
            try:
                self.data.send_multipart(frames, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                self.data.poll(20, zmq.POLLOUT)

    def run_to_end(self) -> None:
        """Lease, produce, done, until `grant end` or `stop`; then bye."""
        while self.stopped is None:
            self.send("lease", want=self.want)
            g = self.wait_for({"grant"}, self.timeout_s)
            if not g["samples"]:
                if g["end"]:
                    break
                self._sleep(g.get("retry_ms", 200) / 1000)
                continue
            s = g["samples"]
            for i in range(0, len(s), self.per_batch):
                self.seq += 1
                bid = f"{self.peer}-{self.seq}"
                self.push(batch_frames(self.run, self.peer, bid, g["lease"], g["epoch"], s[i:i + self.per_batch],
                                       width=self.width))
                self.sent.append(bid)
                self._sleep(self.delay_s)
            self.send("done", lease=g["lease"], skipped=[])
        self.send("bye", reason="done")
        self.log("fake.producer_done", batches=len(self.sent))

    def _sleep(self, s: float) -> None:
        end = time.monotonic() + s
        while time.monotonic() < end:
            self.pump()
            time.sleep(min(0.01, max(0.0, end - time.monotonic())))


class FakeConsumer(FakePeer):
    role = "consumer"

    def __init__(self, broker, instance, *, train_s: float = 0.0, prefetch: int = 1, **kw):
        super().__init__(broker, instance, **kw)
        self.train_s, self.prefetch = train_s, prefetch
        self.data = self.ctx.socket(zmq.PULL)
        self.data.setsockopt(zmq.RCVHWM, prefetch + 1)
        self.data.connect(self.welcome["data_out"])
        self.received: list[dict] = []  # {batch_id, samples, ids_ok, t}
        self.waits: list[float] = []  # seconds between finishing one batch and having the next
        self.step = 0

    def stats(self) -> dict:
        return {"step": self.step, "state": "training", "batches_per_s": 0.0}

    def run_to_end(self, max_s: float = 60.0, on_batch=None) -> None:
        """Credit, take, 'train' (sleep), ack, until `stop`; then commit and bye."""
        self.send("credit", credit=self.prefetch)
        end = time.monotonic() + max_s
        free_at = time.monotonic()
        while self.stopped is None and time.monotonic() < end:
            self.pump()
            if not self.data.poll(5):
                continue
            frames = self.data.recv_multipart()
            t = time.monotonic()
            self.waits.append(t - free_at)
            h = msgpack.unpackb(frames[0])
            ids = array("i", frames[1])
            ok = list(ids) == [s for s, n in zip(h["samples"], h["seq_lens"]) for _ in range(n)]
            self.received.append({"batch_id": h["batch_id"], "samples": h["samples"], "epoch": h["epoch"],
                                  "ids_ok": ok, "t": t})
            self.send("credit", credit=1)  # took one out of the buffer
            if on_batch is not None:
                on_batch(self, h)
            self._train(self.train_s)
            self.step += 1
            self.send("ack", batch_ids=[h["batch_id"]], step=self.step)
            self.log("fake.acked", batch_id=h["batch_id"], samples=h["samples"], step=self.step)
            free_at = time.monotonic()
        if self.stopped is not None:
            self.send("commit", step=self.step, checkpoint=f"fake/step-{self.step}")
            self.send("bye", reason="done")
            self.log("fake.consumer_done", batches=len(self.received), stop=self.stopped)

    def _train(self, s: float) -> None:
        end = time.monotonic() + s
        while True:
            self.pump()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.02))


class Pumping:
    """`with Pumping(a, b):` keeps the peers heartbeating from a thread meanwhile. The
    block must not touch their sockets (ZeroMQ sockets are not thread-safe)."""

    def __init__(self, *peers: FakePeer):
        self.peers, self.done = peers, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.is_set():
            for p in self.peers:
                p.pump()
            time.sleep(0.02)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


# ---------------------------------------------------------------- as a process
# The runner below is shared with the other fake processes (committing_fakes.py,
# stats_fakes.py): they add options and build their own peer classes.


def fake_parser(**defaults) -> argparse.ArgumentParser:
    """The options of every fake process; `defaults` overrides some, callers add theirs."""
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["producer", "consumer"])
    ap.add_argument("--broker", required=True)
    ap.add_argument("--instance", default=None, help="default <role>-<pid>")
    ap.add_argument("--gpu", type=int, default=None, help="the GPU the hello names (none is used)")
    ap.add_argument("--runs-dir", default="runs")
    ap.add_argument("--run", default=None, help="join only this run")
    ap.add_argument("--n-samples", type=int, default=64)
    ap.add_argument("--per-batch", type=int, default=2)
    ap.add_argument("--delay-s", type=float, default=0.0, help="producer: seconds per batch (a slow target)")
    ap.add_argument("--train-s", type=float, default=0.0, help="consumer: seconds per step (a lagging drafter)")
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--max-s", type=float, default=120.0, help="consumer: give up after this long")
    ap.add_argument("--go-file", default=None, help="producer: after the welcome, lease nothing until this file "
                    "exists (a test starts the data once every producer has joined)")
    ap.set_defaults(**defaults)
    return ap


def serve(a: argparse.Namespace, make_peer) -> int:
    """Run one fake process to its end. `make_peer(a, instance, log)` builds the peer
    (`log.info` is a FakePeer `log`). Logs go to the run folder; exit 0 after stop /
    grant end, 3 when rejected, 4 when the broker goes silent."""
    from dflash.runtime.logs import bind_run, close_logging, get_logger, setup_logging

    instance = a.instance or f"{a.role}-{os.getpid()}"
    setup_logging(a.role, instance, gpu=a.gpu)
    log = get_logger()
    try:
        peer = make_peer(a, instance, log)
        bind_run(peer.run, a.runs_dir)
        log.info("fake.joined", peer=peer.peer, data=peer.welcome.get("data_in") or peer.welcome.get("data_out"))
        while getattr(a, "go_file", None) and not os.path.exists(a.go_file):
            peer._sleep(0.05)
        peer.run_to_end(**({"max_s": a.max_s} if a.role == "consumer" else {}))
        peer.close()
        return 0
    except Rejected as e:
        log.error("fake.rejected", reason=str(e))
        print(f"error: broker rejected us: {e}", file=sys.stderr)
        return 3
    except BrokerGone as e:
        log.error("fake.broker_lost", reason=str(e))
        return 4
    finally:
        close_logging()


def _plain_peer(a: argparse.Namespace, instance: str, log) -> FakePeer:
    common = dict(run=a.run, gpu=a.gpu, log=log.info)
    if a.role == "producer":
        return FakeProducer(a.broker, instance, n_samples=a.n_samples, per_batch=a.per_batch, delay_s=a.delay_s,
                            **common)
    return FakeConsumer(a.broker, instance, train_s=a.train_s, prefetch=a.prefetch, **common)


def main(argv=None) -> int:
    return serve(fake_parser().parse_args(argv), _plain_peer)


if __name__ == "__main__":
    sys.exit(main())
