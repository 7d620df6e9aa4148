"""A `BrokerCore` in-process, without sockets or a broker process, driven as the server
drives it: each control message a peer would send is a header that goes through the codec's
checks and broker/inbound.py's `control_message` to the core's typed entry point for its
type; each batch is an `Arrival` (its typed `Batch`). The rig carries out the core's
actions as the server does, with stand-ins for sockets: pipes by port (OpenPipes answered
through `on_pipes`, ClosePipes), a batch's frames by batch ID (DropFrames), each relay
answered through `relayed`. Time is an injected clock that only the test moves. A real
SQLite ledger and run.json in the test's folder.
"""

from __future__ import annotations

import sqlite3

from dflash.broker import runinfo
from dflash.broker.actions import ClosePipes, DropFrames, OpenPipes, Relay, Send
from dflash.broker.config import BrokerConfig
from dflash.broker.core import BrokerCore
from dflash.broker.dispatch import Queued
from dflash.broker.inbound import Arrival, Unreadable, control_message
from dflash.protocol import codec
from dflash.protocol.errors import ProtocolError
from dflash.protocol.messages import CONTROL_TO_BROKER
from dflash.protocol.batch import Batch

RUN = "run-core-test"
N = 8  # samples in the dataset
PORTS = (7000, 7009)
T0 = 1000.0  # the injected clock's start (monotonic seconds)
WALL0 = 1_800_000_000.0  # the wall clock at T0

# A typed control message -> the core's entry point for it (as server.Broker._deliver routes).
ENTRY = {"status": "on_status", "hello": "on_hello", "lease": "on_lease", "done": "on_done", "release": "on_release", "credit": "on_credit",
         "ack": "on_ack", "commit": "on_commit", "lineage": "on_lineage", "heartbeat": "on_heartbeat",
         "bye": "on_bye", "failed": "on_failed"}


class Pipe:
    """A consumer's data-out pipe as the server holds it: what was relayed to it; a `full`
    one takes nothing (as a PUSH not connected yet, or full, refuses a non-blocking send)."""

    def __init__(self, port: int, thread: int):
        self.port, self.thread, self.sent, self.full, self.closed = port, thread, [], False, False


class Rig:
    """A BrokerCore whose pipes bind on any port but those in `taken` (resuming `parent`,
    a resume.Parent), and a clock at `now` that moves only when the test says."""

    def __init__(self, tmp_path, parent=None, streams: int = 1, **cfg):
        opts = dict(num_samples=N, lease_size=4, data_out_ports=PORTS, timeout_s=10.0, heartbeat_s=1.0)
        opts.update(cfg)
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.now = T0
        self.taken: set[int] = set()
        self.bound: list[Pipe] = []  # every pipe bound, in order
        self.pipes: dict[int, Pipe] = {}  # the open ones, by port (as the server's)
        self.frames: dict[str, list] = {}  # batch ID -> its frames, while the core holds it (as the server's)
        self.core = BrokerCore(BrokerConfig(**opts), RUN, tmp_path, "testhost", now=self.now, wall=WALL0,
                               parent=parent, streams=streams)
        runinfo.start(tmp_path, RUN, {}, self.core.endpoints, "main")  # as dflash-broker does
        self.pid = 1000

    def advance(self, dt: float) -> float:
        self.now += dt
        return self.now

    def do(self, actions: list) -> list:
        """Carry out the core's actions as the server does; returns them, with those of the
        `on_pipes` that answers an `OpenPipes` after it."""
        out = []
        for a in actions:
            out.append(a)
            if isinstance(a, OpenPipes):
                out += self.do(self.core.on_pipes(a, self._open(a)))
            elif isinstance(a, ClosePipes):
                for port in a.ports:
                    if port in self.pipes:
                        self.pipes.pop(port).closed = True
            elif isinstance(a, DropFrames):
                for bid in a.batch_ids:
                    self.frames.pop(bid, None)
        return out

    def _open(self, a: OpenPipes) -> list[int]:
        bound = []
        for port in a.ports:
            if len(bound) == len(a.threads):
                break
            if port in self.taken:
                continue  # another process holds it
            self.pipes[port] = Pipe(port, a.threads[len(bound)])
            self.bound.append(self.pipes[port])
            bound.append(port)
        return bound

    def pipe(self, identity: bytes, i: int = 0) -> Pipe:
        """The i-th pipe of the consumer connected as `identity`."""
        return self.pipes[self.peer(identity).pipes.ports[i]]

    def send(self, identity: bytes, h: dict, now: float | None = None) -> list:
        """Header `h` from `identity`, through the server's steps: the codec's checks, the
        typed message (or why it is refused), the entry point for its type."""
        now = self.now if now is None else now
        try:
            codec.check_header(h, allowed=CONTROL_TO_BROKER, run=RUN)
            error = None
        except ProtocolError as e:
            error = e.reason
        msg = control_message(h, error, RUN)
        if isinstance(msg, Unreadable):
            return self.do(self.core.on_unreadable(identity, msg, now))
        return self.do(getattr(self.core, ENTRY[msg.type])(identity, msg, now))

    def control(self, identity: bytes, type_: str, *, run: str | None = RUN, v: int = 1, now=None, **fields):
        h = {"v": v, "type": type_, **({"run": run} if run is not None else {}), **fields}
        return self.send(identity, h, now)

    def hello(self, identity: bytes, role: str, instance: str | None = None, pid: int | None = None, **config):
        self.pid += 1
        return self.control(identity, "hello", run=None, role=role, instance=instance or identity.decode(),
                            host="testhost", pid=self.pid if pid is None else pid, config=config)

    def peer(self, identity: bytes):
        return self.core.sessions.table.by_identity[identity]

    def batch(self, producer: str, lease: int, epoch: int, samples: list[int], batch_id: str | None = None):
        bid = batch_id or f"{producer}-{lease}-{samples[0]}"
        b = Batch(bid, producer, lease, epoch, list(samples), [4] * len(samples), [1, 2])
        return self.arrive(Arrival(b, payload_bytes=100, header_bytes=10), [bid.encode(), b"t" * 100])

    def arrive(self, arrival: Arrival, frames: list) -> list:
        """A batch on data in, as the server hands it over: its frames kept while the core holds it."""
        out = self.do(self.core.on_batch(arrival, self.now))
        bid = arrival.batch.batch_id
        if bid not in self.frames and self.core.holds(bid):
            self.frames[bid] = frames
        return out

    def dispatch(self) -> list[Relay]:
        """A round of dispatch, each relay answered as the server's send would: the batches
        that went out."""
        sent = []
        relay = self.core.dispatch(self.now)
        while relay is not None:
            took = next((port for port in relay.ports if not self.pipes[port].full), None)
            if took is not None:
                self.pipes[took].sent.append(relay.batch_id)  # the frames of it went out
                sent.append(relay)
            relay = self.core.relayed(relay, took, self.now)
        return sent

    def tick(self, now: float | None = None) -> list:
        return self.do(self.core.tick(self.now if now is None else now))

    def status(self) -> dict:
        return self.core.status_map(self.now)

    def produce(self, identity: bytes = b"prod", want: int = 4) -> tuple[str, dict]:
        """Hello (if new), lease, and one batch per lease of all its samples."""
        if identity not in self.core.sessions.table.by_identity:
            assert sent(self.hello(identity, "producer"), "welcome")
        grant = sent(self.control(identity, "lease", want=want), "grant")[0].fields
        p = self.peer(identity).id
        if grant["lease"]:
            self.batch(p, grant["lease"], grant["epoch"], grant["samples"])
        return p, grant

    def consumer(self, identity: bytes = b"cons", credit: int = 8, **config) -> str:
        assert sent(self.hello(identity, "consumer", **config), "welcome")
        self.control(identity, "credit", credit=credit)
        return self.peer(identity).id

    def in_flight(self, identity: bytes) -> list[str]:
        return list(self.peer(identity).in_flight)

    def close(self) -> list:
        return self.do(self.core.close())

    def __enter__(self) -> "Rig":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sent(actions: list, type_: str) -> list[Send]:
    return [a for a in actions if isinstance(a, Send) and a.type == type_]


def codes(actions: list) -> list[str]:
    return [a.fields["code"] for a in sent(actions, "reject")]


def ledger_states(core) -> dict[str, int]:
    core.ledger.flush()
    core.ledger.sync()
    db = sqlite3.connect(core.ledger.path)
    try:
        return dict(db.execute("SELECT state, COUNT(*) FROM samples GROUP BY state").fetchall())
    finally:
        db.close()


def queued(batch_id: str, samples: list[int], tokens: int, nbytes: int, *, producer: str = "p1", lease: int = 1,
           epoch: int = 0, now: float = T0) -> Queued:
    """A batch as the broker holds it (dispatch.Queued) of `tokens` tokens in all."""
    seq_lens = [tokens - (len(samples) - 1)] + [1] * (len(samples) - 1)
    return Queued(Batch(batch_id, producer, lease, epoch, list(samples), seq_lens, [1]), nbytes, now)
