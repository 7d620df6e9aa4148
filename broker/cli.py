"""`dflash-broker`: create a run and serve it until end of stream or a signal.

Exit status: 0 when the run completed (every consumer said bye after `stop`) or was
stopped by SIGINT/SIGTERM after a clean shutdown (run.json says which); 2 on bad
options; 1 if the broker could not start (e.g. a port in use) or crashed.
"""

from __future__ import annotations

import signal
import sys

import click
import zmq

from dflash.protocol.alloc import reuse_freed_memory
from dflash.protocol import curve
from dflash.protocol.config import as_dict, command, config_option, fail, option, runs_dir_option
from dflash.protocol.logs import bind_run, close_logging, get_logger, setup_logging
from dflash.protocol.messages import MAX_MESSAGE_BYTES
from dflash.protocol.run import hostname, make_run_dir, new_run_id, point_latest

from . import resume, runinfo, security
from .config import BrokerConfig, parse_bytes, parse_port_range
from .ledger import SCHEMA_VERSION
from .server import Broker


@command("BROKER", max_content_width=100)
@config_option()
@option("--bind", default="*", help="Interface to bind every socket on ('*' = all, 127.0.0.1 = this host only).")
@option("--port", default=5555, type=int, help="Control port: the one address peers and dflash-status dial.")
@option("--data-in-port", default=5556, type=int, help="Port producers push batches to (announced in welcome).")
@option("--data-out-ports", default="5557-5620",
        help="Port range for the per-consumer data pipes, one port per data stream of each live consumer "
             "(--data-streams; open it in firewalls).")
@option("--advertise-host", default=None,
        help="Host name or IP peers should dial for data in/out; default: --bind if concrete, else this host's name.")
@runs_dir_option()
@option("--instance", default="main", help="This broker's name: its log is runs/<run_id>/logs/broker-<instance>.jsonl.")
@option("--epochs", default=1, type=int, help="Passes over the dataset; each epoch has its own shuffled order.")
@option("--seed", default=0, type=int, help="Seed of the per-epoch sample order (same seed -> same order).")
@option("--queue-bytes", default="4GiB",
        help="Most batch bytes the shared queue holds; when full the broker stops reading producers (backpressure).")
@option("--max-message-bytes", default=str(MAX_MESSAGE_BYTES),
        help="Largest batch accepted (bytes, or e.g. 512MiB); larger ones are dropped and logged.")
@option("--heartbeat-s", default=1.0, type=float, help="Seconds between heartbeats the broker sends and expects.")
@option("--timeout-s", default=10.0, type=float,
        help="A peer silent this long is declared lost and its work requeued (keep it above one batch transfer).")
@option("--lease-size", default=256, type=int, help="Most samples handed to a producer per lease.")
@option("--num-samples", default=None, type=int,
        help="Dataset size; normally the first producer tells it (config.dataset.n_samples) and later ones must match.")
@option("--consumers", default=0, type=int,
        help="Data-parallel ranks: consumers get ranks 0..N-1 in hello order (a lost rank's number goes to the "
             "next to join). With N >= 2 and --elastic, N is the most at once and training goes on while at "
             "least one is left. 0 = do not arrange ranks.")
@option("--elastic/--no-elastic", default=True,
        help="With --consumers N >= 2: run a torchft lighthouse so consumers train elastically (a dead one is "
             "left out, a restarted one rejoins and is healed: docs/RELIABILITY.md section 8). --no-elastic: one "
             "fixed torch.distributed group that ends when a rank is lost.")
@option("--lighthouse-port", default=0, type=int,
        help="Port of the elastic consumers' torchft lighthouse (on --bind); 0 = any free port.")
@option("--io-threads", default=0, type=int,
        help="ZeroMQ I/O threads. 2: control and batches in on the first, consumers' pipes on the second, so "
             "the relay's two copies run on two cores; 3 or more: control alone on the first, batches in on the "
             "next (n-1)//2, each consumer's pipe on one of the rest. 0 = auto: 1 below 8 usable cores, else "
             "1 + one per 8 cores, at most 5 (docs/BENCHMARKS.md, transport).")
@option("--data-streams", default=0, type=int,
        help="TCP connections that carry each peer's batches, each on its own I/O thread while there are "
             "enough: a consumer's each with a data-out port of its own, a producer's all to --data-in-port; "
             "batches take them in turn. 0 = auto: one per I/O thread the broker has for that direction (see "
             "--io-threads), at most 2 (docs/BENCHMARKS.md, transport).")
@option("--progress-s", default=10.0, type=float, help="Seconds between broker.progress summary log lines.")
@option("--metrics-port", default=0, type=int,
        help="Serve the status map as Prometheus text on http://BIND:PORT/metrics (0 = off).")
@option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]),
        help="Lowest level logged.")
@option("--max-peers", default=256, type=int,
        help="Most live producer+consumer sessions; more hellos are refused ('full'). Bounds what a flood "
             "of hellos can make the broker hold.")
@option("--curve-keys", default=None, metavar="DIR",
        help="CurveZMQ on: encrypt every socket and admit only peers whose public key is in DIR/authorized/ "
             "(the broker's keypair is DIR/broker.key_secret; make keys with dflash-keygen). Off = plain TCP, "
             "fit for loopback only (docs/SECURITY.md).")
@option("--drain-s", default=120.0, type=float,
        help="On SIGINT/SIGTERM, the longest wait for consumers to checkpoint, commit and leave before "
             "exiting (a second signal exits at once); their last commit is recorded only meanwhile.")
@option("--resume", default=None, metavar="RUN",
        help="Continue RUN (run ID, runs/<id> folder, or 'latest') as a new run: what it committed is never "
             "trained again, everything else is made again, in the same per-epoch order (its --seed). "
             "Consumers load the checkpoint of its last commit. Producers/consumers may number differently.")
def main(**opts) -> None:
    """The dflash broker: creates a run, hands out work leases to producers, queues their
    hidden-state batches (bounded in bytes) and dispatches them to consumers by credit.

    Prints one JSON log line per event (key=value on a terminal) and writes the same to
    runs/<run_id>/logs/broker-<instance>.jsonl. See docs/PROTOCOL.md and docs/LOGS.md.
    """
    parent = None
    try:
        for name in ("queue_bytes", "max_message_bytes"):  # named: the value may come from env or --config
            try:
                opts[name] = parse_bytes(opts[name])
            except ValueError as e:
                raise ValueError(f"--{name.replace('_', '-')} (env DFLASH_BROKER_{name.upper()}, or --config): {e}") from None
        opts["data_out_ports"] = parse_port_range(opts["data_out_ports"])
        cfg = BrokerConfig(**opts)
        if cfg.curve_keys:
            curve.server_keys(cfg.curve_keys)  # a missing key is a one-line error now, not at bind
        if cfg.resume:
            parent = resume.load(cfg.resume, cfg.runs_dir)
            cfg = resume.effective_config(cfg, parent, _explicit(("seed", "epochs", "num_samples")))
        cfg.check()
    except (ValueError, TypeError, curve.CurveKeyError) as e:  # resume.ResumeError is a ValueError
        fail(str(e))
    sys.exit(run(cfg, parent))


def _explicit(names: tuple[str, ...]) -> set[str]:
    """Which of `names` the user set (command line, env var or --config), not defaults."""
    ctx = click.get_current_context()
    return {n for n in names if ctx.get_parameter_source(n) is not click.core.ParameterSource.DEFAULT}


def run(cfg: BrokerConfig, parent: resume.Parent | None = None) -> int:
    """Create the run, serve it, record the outcome. Returns the exit status."""
    reuse_freed_memory()  # before ZeroMQ starts its I/O threads: see protocol/alloc.py
    setup_logging("broker", cfg.instance, level=cfg.log_level)
    log = get_logger()
    run_id = new_run_id()
    run_dir = make_run_dir(run_id, cfg.runs_dir)
    bind_run(run_id, cfg.runs_dir)
    host = hostname()
    lineage = {"parent_run": parent.run_id, "resumed_from": parent.summary()} if parent else {}
    try:
        broker = Broker(cfg, run_id, run_dir, host, parent)
    except (zmq.ZMQError, OSError) as e:  # OSError: the --metrics-port HTTP server
        log.error("broker.start_failed", error=str(e), port=cfg.port, data_in_port=cfg.data_in_port,
                  metrics_port=cfg.metrics_port)
        runinfo.start(run_dir, run_id, as_dict(cfg), {}, cfg.instance, **lineage)
        runinfo.finish(run_dir, "failed", error=f"cannot bind: {e}")
        ports = f"{cfg.port}/{cfg.data_in_port}" + (f"/{cfg.metrics_port}" if cfg.metrics_port else "")
        click.echo(f"error: cannot bind ports {ports} on {cfg.bind}: {e}", err=True)
        close_logging()
        return 1
    runinfo.start(run_dir, run_id, as_dict(cfg), broker.endpoints, cfg.instance, **lineage)
    point_latest(run_id, cfg.runs_dir)
    broker.ledger.set_meta(run_id=run_id, schema=SCHEMA_VERSION, seed=cfg.seed, epochs=cfg.epochs,
                           config=as_dict(cfg))
    security.warn_if_open(cfg.bind, bool(cfg.curve_keys))
    if parent is not None:
        log.info("broker.resume", **lineage["resumed_from"], left=resume.left_to_do(parent, cfg.epochs),
                 epochs=cfg.epochs, seed=cfg.seed)

    def on_signal(signum, _frame):
        broker.signal = signal.Signals(signum).name  # acted on by the loop, never here
        broker.signals += 1

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    log.info("broker.start", config=as_dict(cfg), endpoints=broker.endpoints, run_dir=str(run_dir),
             io_threads=broker.io_threads, data_streams=broker.streams, producer_streams=broker.producer_streams)
    outcome, error = "crashed", None
    try:
        outcome = broker.serve()
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        log.exception("broker.crashed", error=error)
    finally:
        samples = dict(broker.ledger.counts)
        broker.close()
        why = getattr(broker, "outcome_why", None)
        code = 1 if error is not None else EXIT_NOTHING_TO_TRAIN if outcome == "nothing_to_train" else 0
        runinfo.finish(run_dir, outcome, samples=samples, error=error, signal=broker.signal,
                       **({"reason": why} if why else {}))
        log.info("broker.exit", outcome=outcome, exit_code=code)
        close_logging()
    if outcome == "nothing_to_train":
        click.echo(f"error: nothing to train in run {run_id}: {why}", err=True)
    return code


# A run that reached end of stream without training anything: not a success (issue 19).
EXIT_NOTHING_TO_TRAIN = 3


if __name__ == "__main__":
    main()
