"""The broker's one frozen config and the small parsers the CLI needs for it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from dflash.protocol.messages import CONTROL_MAX_BYTES, MAX_MESSAGE_BYTES  # noqa: F401  (CONTROL_MAX_BYTES re-exported)
from dflash.runtime.command_line import parse_bytes  # noqa: F401  (re-exported: the broker CLI and tests import it here)


def __getattr__(name: str):
    """The socket constants, imported when first asked for: the broker core (core.py) imports
    this module and must not import ZeroMQ (tests and the CLI import them here)."""
    if name in ("AUTO_DATA_STREAMS", "AUTO_TWO_IO_CPUS", "usable_cpus"):
        from dflash.protocol import sockets

        return getattr(sockets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Credit a consumer may hold (PROTOCOL.md 4.5) and how many delivered-but-unacked
# batches the broker keeps for one consumer: both bound what the broker holds in memory
# for a consumer that takes batches and never acks them.
MAX_CREDIT = 64
MAX_UNACKED = 2 * MAX_CREDIT


def data_in_frame_cap(max_message_bytes: int) -> int:
    """ZMQ_MAXMSGSIZE of data in: twice --max-message-bytes, not the limit itself. libzmq
    drops a frame over its cap by closing the connection, with nothing to say why (its
    monitor's disconnect event is the same as a producer exiting, and the message is
    gone), and the producer's PUSH reconnects unaware. Under the cap the broker reads the
    header, so a batch over the limit is logged with its producer, size and limit and that
    producer is told (intake.too_large); the cap stays a bound on what one frame can make
    the broker allocate. Our ProducerLink never sends over the limit (it checks first)."""
    return 2 * max_message_bytes


# Control messages ZeroMQ may queue per connection, each way. Normal traffic is a few
# small messages per second per peer; the bound is what a peer that floods (or never
# reads its replies) can make the broker hold: RCVHWM x CONTROL_MAX_BYTES in, SNDHWM x
# one reply out. A full in-pipe stops ZeroMQ reading that TCP connection: backpressure,
# not loss.
CONTROL_RCVHWM = 100
CONTROL_SNDHWM = 1000
# Largest `hello.config` kept for a session (as JSON): sessions are bounded in number
# (--max-peers) and each keeps its config, so each must be small.
MAX_HELLO_CONFIG_BYTES = 64 * 1024
# Messages a producer's pipe may hold inside the broker's ZeroMQ before TCP pushes back.
# Small because one message can be ~1 GiB: the broker's memory is the byte-bounded
# queue plus at most this many messages per producer connection (--data-streams of them).
DATA_IN_RCVHWM = 2
# The relay copies every byte twice (TCP in, TCP out), and one ZeroMQ I/O thread doing
# both saturates one core (docs/BENCHMARKS.md, transport). With two, data-in runs on
# one thread and the consumers' pipes on the other(s) (ZMQ_AFFINITY). One consumer's
# batches travel on one connection, so one thread; with several consumers their pipes
# spread over the threads after the first, up to MAX_AUTO_OUT_THREADS of them, one per 8
# usable cores (a thread never idle-spins: an unused one costs nothing).
MAX_IO_THREADS = 16
MAX_DATA_STREAMS = 8
MAX_AUTO_OUT_THREADS = 4


def auto_broker_io_threads(cpus: int) -> int:
    """1 below AUTO_TWO_IO_CPUS cores (on 2 cores a second thread is slower: docs/BENCHMARKS.md), else the
    first thread plus one per 8 cores for the consumers' pipes (at most MAX_AUTO_OUT_THREADS)."""
    from dflash.protocol.sockets import AUTO_TWO_IO_CPUS

    if cpus < AUTO_TWO_IO_CPUS:
        return 1
    return 1 + min(MAX_AUTO_OUT_THREADS, cpus // 8)


@dataclass(frozen=True)
class BrokerConfig:
    bind: str = "*"
    port: int = 5555
    data_in_port: int = 5556
    data_out_ports: tuple[int, int] = (5557, 5620)
    advertise_host: str | None = None
    runs_dir: str = "runs"
    instance: str = "main"
    epochs: int = 1
    seed: int = 0
    queue_bytes: int = 4 << 30
    max_message_bytes: int = MAX_MESSAGE_BYTES
    heartbeat_s: float = 1.0
    timeout_s: float = 10.0
    ack_timeout_s: float = 0.0  # no ack this long while holding batches: lost (0 = auto, ack_deadline)
    lease_size: int = 256
    num_samples: int | None = None
    consumers: int = 0
    progress_s: float = 10.0
    metrics_port: int = 0  # Prometheus text on http://HOST:PORT/metrics; 0 = off
    tensorboard: str | None = None  # broker.progress figures as TensorBoard scalars under DIR/<run_id>
    wandb: str | None = None  # ... and to this Weights & Biases project
    log_level: str = "info"
    resume: str | None = None  # the run this one continues (resume.py), as the user named it
    force_resume: bool = False  # resume it even though another run resumed it already (resume.py)
    max_peers: int = 256  # live sessions (producers + consumers): what a hello flood can make us hold
    curve_keys: str | None = None  # CurveZMQ keys folder (protocol/curve.py); None = plain TCP
    drain_s: float = 120.0  # on SIGINT/SIGTERM: longest wait for peers' last commit and bye
    elastic: bool = True  # consumers (--consumers N >= 2) train elastically through a torchft lighthouse
    lighthouse_port: int = 0  # the lighthouse's port; 0 = any free one
    io_threads: int = 0  # ZeroMQ I/O threads; 0 = auto (io_thread_count)
    data_streams: int = 0  # TCP connections per peer for its batches; 0 = auto (stream_count)
    quarantine_after: int = 2  # consumers that fail on one batch before it is quarantined (quarantine.py)
    time_budget: float | None = None  # seconds from the broker's start the run must end within (budget.py)

    def check(self) -> None:
        """Raises ValueError with a one-line reason if the values cannot work together."""
        lo, hi = self.data_out_ports
        ports = [self.port, self.data_in_port, lo, hi]
        if not all(0 < p < 65536 for p in ports):
            raise ValueError(f"ports must lie in 1..65535, got {ports}")
        if lo > hi:
            raise ValueError(f"--data-out-ports {lo}-{hi}: first port above last")
        if lo <= self.port <= hi or lo <= self.data_in_port <= hi or self.port == self.data_in_port:
            raise ValueError("--port, --data-in-port and --data-out-ports must not overlap")
        if self.epochs < 1 or self.lease_size < 1 or self.queue_bytes < 1:
            raise ValueError("--epochs, --lease-size and --queue-bytes must be positive")
        if not 0 < self.max_message_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"--max-message-bytes must lie in 1..{MAX_MESSAGE_BYTES}")
        if self.heartbeat_s <= 0 or self.timeout_s <= 2 * self.heartbeat_s:
            raise ValueError("--timeout-s must exceed two heartbeats (--heartbeat-s > 0)")
        if self.ack_timeout_s < 0:
            raise ValueError("--ack-timeout-s must be >= 0 (0 = auto)")
        if self.num_samples is not None and self.num_samples < 0:
            raise ValueError("--num-samples must be >= 0")
        if self.consumers < 0:
            raise ValueError("--consumers must be >= 0")
        if self.max_peers < 1:
            raise ValueError("--max-peers must be >= 1")
        if self.time_budget is not None and not 0 < self.time_budget < float("inf"):
            raise ValueError(f"--time-budget {self.time_budget}: must be a positive duration")
        if self.quarantine_after < 1:
            raise ValueError("--quarantine-after must be >= 1")
        if self.metrics_port and (not 0 < self.metrics_port < 65536
                                  or self.metrics_port in (self.port, self.data_in_port)
                                  or lo <= self.metrics_port <= hi):
            raise ValueError(f"--metrics-port {self.metrics_port}: use a free port in 1..65535 "
                             "outside the other ports (0 = off)")
        if not 0 <= self.lighthouse_port < 65536:
            raise ValueError(f"--lighthouse-port {self.lighthouse_port}: use 1..65535 (0 = any free port)")
        if not 0 <= self.io_threads <= MAX_IO_THREADS:
            raise ValueError(f"--io-threads {self.io_threads}: use 1..{MAX_IO_THREADS} (0 = auto)")
        if not 0 <= self.data_streams <= MAX_DATA_STREAMS:
            raise ValueError(f"--data-streams {self.data_streams}: use 1..{MAX_DATA_STREAMS} (0 = auto)")
        if self.data_streams > hi - lo + 1:
            raise ValueError(f"--data-streams {self.data_streams} needs that many ports per consumer; "
                             f"--data-out-ports {lo}-{hi} has {hi - lo + 1}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.instance):
            raise ValueError(f"--instance {self.instance!r}: use letters, digits, '.', '_', '-'")

    def ack_deadline(self, slowest_gap_s: float) -> float:
        """Seconds a consumer may hold delivered batches without an ack: --ack-timeout-s, or
        auto: above the consumers' own waits (an elastic start waits up to 60 s for the
        other ranks, a quorum 60 s, a first GPU step compiles for about a minute), scaled
        with --timeout-s, and never below 4 of that consumer's slowest steps so far."""
        if self.ack_timeout_s:
            return self.ack_timeout_s
        return max(120.0, 12 * self.timeout_s, 4 * slowest_gap_s)

    def io_thread_count(self) -> int:
        """--io-threads, or auto (auto_broker_io_threads of the cores this process may use)."""
        from dflash.protocol.sockets import usable_cpus

        return self.io_threads or auto_broker_io_threads(usable_cpus())

    def stream_count(self, threads: int) -> int:
        """--data-streams, or auto: one per I/O thread the broker has for that direction
        (batches in, or the consumers' pipes), at most AUTO_DATA_STREAMS; one where there is
        a single thread (a second stream would only take turns on it)."""
        from dflash.protocol.sockets import AUTO_DATA_STREAMS

        return self.data_streams or max(1, min(AUTO_DATA_STREAMS, threads))

    def host_to_advertise(self, hostname: str) -> str:
        """What peers should dial: --advertise-host, else a concrete --bind, else our name."""
        if self.advertise_host:
            return self.advertise_host
        if self.bind not in ("*", "0.0.0.0", "::", "[::]"):
            return self.bind
        return hostname


def parse_port_range(text: str) -> tuple[int, int]:
    """'5557-5620' (or one port) -> (5557, 5620). Raises ValueError."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+))?\s*", text)
    if not m:
        raise ValueError(f"{text!r} is not a port range like 5557-5620")
    lo = int(m.group(1))
    return lo, int(m.group(2) or lo)
