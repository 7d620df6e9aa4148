"""The broker's one frozen config, each field the dflash-broker option of its name (its default,
help and type declared once, here), and the small parsers its options need."""

from __future__ import annotations

import re
from dataclasses import dataclass

import click

from dflash.protocol.messages import MAX_MESSAGE_BYTES
from dflash.runtime.command_line import log_level_setting, parse_bytes, runs_dir_setting, setting


def __getattr__(name: str):
    """The socket constants, imported lazily: core.py imports this module and must not import ZeroMQ."""
    if name in ("AUTO_DATA_STREAMS", "AUTO_TWO_IO_CPUS", "usable_cpus"):
        from dflash.protocol import sockets

        return getattr(sockets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Credit a consumer may hold (PROTOCOL.md 4.5) and unacked batches kept for it: bounds on a consumer that never acks.
MAX_CREDIT = 64
MAX_UNACKED = 2 * MAX_CREDIT


def data_in_frame_cap(max_message_bytes: int) -> int:
    """ZMQ_MAXMSGSIZE of data in: twice --max-message-bytes, since libzmq drops a frame over its cap
    silently by closing the connection; under it the broker can read and refuse it, saying why."""
    return 2 * max_message_bytes


# Control messages queued per connection each way: bounds what a flooding peer makes the broker hold
# (a full in-pipe stops ZeroMQ reading that connection: backpressure, not loss).
CONTROL_RCVHWM = 100
CONTROL_SNDHWM = 1000
# Largest `hello.config` kept per session (as JSON): each of --max-peers sessions keeps one.
MAX_HELLO_CONFIG_BYTES = 64 * 1024
# Messages a producer connection may hold inside ZeroMQ before TCP pushes back: small, as one is a whole batch.
DATA_IN_RCVHWM = 2
# The relay copies every byte twice, which saturates one I/O thread's core: data in and the
# consumers' pipes get threads of their own (ZMQ_AFFINITY); an unused thread costs nothing.
MAX_IO_THREADS = 16
MAX_DATA_STREAMS = 8
MAX_AUTO_OUT_THREADS = 4


def auto_broker_io_threads(cpus: int) -> int:
    """1 below AUTO_TWO_IO_CPUS cores (a second thread is slower there), else 1 + one per 8 cores."""
    from dflash.protocol.sockets import AUTO_TWO_IO_CPUS

    if cpus < AUTO_TWO_IO_CPUS:
        return 1
    return 1 + min(MAX_AUTO_OUT_THREADS, cpus // 8)


class Duration(click.ParamType):
    """600, 600s, 10m, 1h30m -> seconds (budget.parse_duration); click names the option on error."""

    name = "duration"

    def convert(self, value, param, ctx):
        from .budget import parse_duration

        try:
            return parse_duration(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


def parse_port_range(text: str) -> tuple[int, int]:
    """'5557-5620' (or one port) -> (5557, 5620). Raises ValueError."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+))?\s*", text)
    if not m:
        raise ValueError(f"{text!r} is not a port range like 5557-5620")
    lo = int(m.group(1))
    return lo, int(m.group(2) or lo)


@dataclass(frozen=True)
class BrokerConfig:
    """The broker's settings; each field is the dflash-broker option of its name, in --help order."""

    bind: str = setting("*", help="Interface to bind every socket on ('*' = all, 127.0.0.1 = this host only).")
    port: int = setting(5555, help="Control port: the one address peers and dflash-status dial.")
    data_in_port: int = setting(5556, help="Port producers push batches to (announced in welcome).")
    data_out_ports: tuple[int, int] = setting(
        "5557-5620", parse=parse_port_range,
        help="Port range for the per-consumer data pipes, one port per data stream of each live consumer "
             "(--data-streams; open it in firewalls).")
    advertise_host: str | None = setting(
        None, help="Host name or IP peers should dial for data in/out; default: --bind if concrete, else this host's name.")
    runs_dir: str = runs_dir_setting()
    instance: str = setting("main", help="This broker's name: its log is runs/<run_id>/logs/broker-<instance>.jsonl.")
    epochs: int = setting(1, help="Passes over the dataset; each epoch has its own shuffled order.")
    time_budget: float | None = setting(
        None, type=Duration(), metavar="DURATION",
        help="End the run within this time from the broker's start (600, 600s, 10m, 1h30m): the broker plans the "
             "samples trained from the measured rate, so the consumers' lr anneals to --min-lr as the last planned "
             "sample is trained and everything trained is committed before the deadline (docs/TRAINING.md, "
             "\"A recipe for a time budget\"). Never more than --epochs over the dataset. Default: no budget.")
    seed: int = setting(0, help="Seed of the per-epoch sample order (same seed -> same order).")
    queue_bytes: int = setting(
        "4GiB", parse=parse_bytes,
        help="Most batch bytes the shared queue holds; when full the broker stops reading producers (backpressure).")
    max_message_bytes: int = setting(
        str(MAX_MESSAGE_BYTES), parse=parse_bytes,
        help="Largest batch accepted (bytes, or e.g. 512MiB); larger ones are dropped and logged.")
    heartbeat_s: float = setting(1.0, help="Seconds between heartbeats the broker sends and expects.")
    timeout_s: float = setting(
        10.0, help="A peer silent this long is declared lost and its work requeued (keep it above one batch transfer).")
    ack_timeout_s: float = setting(
        0.0, help="A consumer holding delivered batches that acks none for this long is declared lost and its "
                  "batches requeued (it heartbeats, so --timeout-s does not catch it). 0: auto, the larger of 120 s, "
                  "12 x --timeout-s and 4 x that consumer's slowest gap between two acks.")
    lease_size: int = setting(256, help="Most samples handed to a producer per lease.")
    quarantine_after: int = setting(
        2, help="A batch that this many consumers fail on (each reports it and leaves) is quarantined: its samples "
                "are made again once, and set aside, counted by reason, if their new batch fails as well "
                "(docs/RELIABILITY.md, poison batches).")
    num_samples: int | None = setting(
        None, help="Dataset size; normally the first producer tells it (config.dataset.n_samples) and later ones must match.")
    consumers: int = setting(
        0, help="Data-parallel ranks: consumers get ranks 0..N-1 in hello order (a lost rank's number goes to the "
                "next to join). With N >= 2 and --elastic, N is the most at once and training goes on while at "
                "least one is left. 0 = do not arrange ranks.")
    elastic: bool = setting(
        True, help="With --consumers N >= 2: run a torchft lighthouse so consumers train elastically (a dead one is "
                   "left out, a restarted one rejoins and is healed: docs/RELIABILITY.md section 8). --no-elastic: one "
                   "fixed torch.distributed group that ends when a rank is lost.")
    lighthouse_port: int = setting(
        0, help="Port of the elastic consumers' torchft lighthouse (on --bind); 0 = any free port.")
    io_threads: int = setting(  # 0 = auto (io_thread_count)
        0, help="ZeroMQ I/O threads. 2: control and batches in on the first, consumers' pipes on the second, so "
                "the relay's two copies run on two cores; 3 or more: control alone on the first, batches in on the "
                "next (n-1)//2, each consumer's pipe on one of the rest. 0 = auto: 1 below 8 usable cores, else "
                "1 + one per 8 cores, at most 5 (docs/BENCHMARKS.md, transport).")
    data_streams: int = setting(  # TCP connections per peer for its batches; 0 = auto (stream_count)
        0, help="TCP connections that carry each peer's batches, each on its own I/O thread while there are "
                "enough: a consumer's each with a data-out port of its own, a producer's all to --data-in-port; "
                "batches take them in turn. 0 = auto: one per I/O thread the broker has for that direction (see "
                "--io-threads), at most 2 (docs/BENCHMARKS.md, transport).")
    progress_s: float = setting(10.0, help="Seconds between broker.progress summary log lines.")
    tensorboard: str | None = setting(
        None, metavar="DIR", type=click.Path(file_okay=False),
        help="Also write each broker.progress line's figures as TensorBoard scalars under DIR/<run_id>, named as "
             "the JSON fields (broker.progress/samples_per_s, broker.progress/queue_bytes), at the seconds since start; "
             "needs the tensorboard extra.")
    wandb: str | None = setting(
        None, metavar="PROJECT",
        help="Also log each broker.progress line's figures to Weights & Biases PROJECT (run <run_id>-broker, files "
             "in the run folder); WANDB_MODE=offline writes them locally only. Needs the wandb extra.")
    metrics_port: int = setting(0, help="Serve the status map as Prometheus text on http://BIND:PORT/metrics (0 = off).")
    log_level: str = log_level_setting()
    max_peers: int = setting(
        256, help="Most live producer+consumer sessions; more hellos are refused ('full'). Bounds what a flood "
                  "of hellos can make the broker hold.")
    curve_keys: str | None = setting(  # CurveZMQ keys folder (protocol/curve.py); None = plain TCP
        None, metavar="DIR",
        help="CurveZMQ on: encrypt every socket and admit only peers whose public key is in DIR/authorized/ "
             "(the broker's keypair is DIR/broker.key_secret; make keys with dflash-keygen). Off = plain TCP, "
             "fit for loopback only (docs/SECURITY.md).")
    drain_s: float = setting(
        120.0, help="On SIGINT/SIGTERM, the longest wait for consumers to checkpoint, commit and leave before "
                    "exiting (a second signal exits at once); their last commit is recorded only meanwhile.")
    resume: str | None = setting(  # the run this one continues (resume.py), as the user named it
        None, metavar="RUN",
        help="Continue RUN (run ID, runs/<id> folder, or 'latest') as a new run: what it committed is never "
             "trained again, everything else is made again, in the same per-epoch order (its --seed). "
             "Consumers load the checkpoint of its last commit. Producers/consumers may number differently. "
             "A run another run resumed already is refused (resume the end of its chain).")
    force_resume: bool = setting(
        False, help="With --resume: resume RUN even though another run resumed it already, as a second branch from "
                    "RUN's last commit (what the first continuation trained since is trained again, into another drafter).")

    def check(self) -> None:
        """Raises ValueError with a one-line reason if the values cannot work together."""
        self._check_ports()
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
        if not 0 <= self.io_threads <= MAX_IO_THREADS:
            raise ValueError(f"--io-threads {self.io_threads}: use 1..{MAX_IO_THREADS} (0 = auto)")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.instance):
            raise ValueError(f"--instance {self.instance!r}: use letters, digits, '.', '_', '-'")

    def _check_ports(self) -> None:
        """check()'s part for the ports and the data streams they carry."""
        lo, hi = self.data_out_ports
        ports = [self.port, self.data_in_port, lo, hi]
        if not all(0 < p < 65536 for p in ports):
            raise ValueError(f"ports must lie in 1..65535, got {ports}")
        if lo > hi:
            raise ValueError(f"--data-out-ports {lo}-{hi}: first port above last")
        if lo <= self.port <= hi or lo <= self.data_in_port <= hi or self.port == self.data_in_port:
            raise ValueError("--port, --data-in-port and --data-out-ports must not overlap")
        if self.metrics_port and (not 0 < self.metrics_port < 65536
                                  or self.metrics_port in (self.port, self.data_in_port)
                                  or lo <= self.metrics_port <= hi):
            raise ValueError(f"--metrics-port {self.metrics_port}: use a free port in 1..65535 "
                             "outside the other ports (0 = off)")
        if not 0 <= self.lighthouse_port < 65536:
            raise ValueError(f"--lighthouse-port {self.lighthouse_port}: use 1..65535 (0 = any free port)")
        if not 0 <= self.data_streams <= MAX_DATA_STREAMS:
            raise ValueError(f"--data-streams {self.data_streams}: use 1..{MAX_DATA_STREAMS} (0 = auto)")
        if self.data_streams > hi - lo + 1:
            raise ValueError(f"--data-streams {self.data_streams} needs that many ports per consumer; "
                             f"--data-out-ports {lo}-{hi} has {hi - lo + 1}")

    def ack_deadline(self, slowest_gap_s: float) -> float:
        """Seconds a consumer may hold batches without an ack: --ack-timeout-s, or auto: above the
        consumers' own waits (rank start, quorum, first compile), and 4 of its slowest steps."""
        if self.ack_timeout_s:
            return self.ack_timeout_s
        return max(120.0, 12 * self.timeout_s, 4 * slowest_gap_s)

    def io_thread_count(self) -> int:
        """--io-threads, or auto (auto_broker_io_threads of the cores this process may use)."""
        from dflash.protocol.sockets import usable_cpus

        return self.io_threads or auto_broker_io_threads(usable_cpus())

    def stream_count(self, threads: int) -> int:
        """--data-streams, or auto: one per I/O thread of that direction, at most AUTO_DATA_STREAMS."""
        from dflash.protocol.sockets import AUTO_DATA_STREAMS

        return self.data_streams or max(1, min(AUTO_DATA_STREAMS, threads))

    def host_to_advertise(self, hostname: str) -> str:
        """What peers should dial: --advertise-host, else a concrete --bind, else our name."""
        if self.advertise_host:
            return self.advertise_host
        if self.bind not in ("*", "0.0.0.0", "::", "[::]"):
            return self.bind
        return hostname

