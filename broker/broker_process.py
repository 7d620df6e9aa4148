"""One broker process, given its `BrokerConfig` (broker_command.py makes it from the options):
create the run, serve it (server.py) until end of stream or a signal, record how it ended.

Exit status (`run` returns it): 0 when the run completed (every consumer said bye after
`stop`) or was stopped by SIGINT/SIGTERM after a clean shutdown (run.json says which); 1 if
the broker could not start (e.g. a port in use) or crashed; 3 when it had nothing to train.
Bad options exit 2 before (broker_command.py).
"""

from __future__ import annotations

import shutil
import time

import click
import zmq

from dflash.runtime.alloc import reuse_freed_memory
from dflash.runtime.command_line import as_dict
from dflash.runtime.fdlimit import raise_open_files
from dflash.runtime.logs import bind_run, close_logging, get_logger, setup_logging
from dflash.runtime.run import StorageError, give_back_latest, hostname, latest_run, make_run_dir, new_run_id, point_latest
from dflash.runtime.stop import GracefulStop

from . import resume, runinfo, security
from .config import BrokerConfig
from .ledger import SCHEMA_VERSION
from .server import Broker

# A run that reached end of stream without training anything: not a success (issue 19).
EXIT_NOTHING_TO_TRAIN = 3
STORAGE_HINT = ("free space under --runs-dir, then `dflash-broker --resume` (what the ledger committed before the "
                "refused write stands; the rest is made again)")


def run(cfg: BrokerConfig, parent: resume.Parent | None = None) -> int:
    """Create the run, serve it, record the outcome. Returns the exit status."""
    reuse_freed_memory()  # before ZeroMQ starts its I/O threads: see runtime/alloc.py
    setup_logging("broker", cfg.instance, level=cfg.log_level)
    log = get_logger()
    run_id = new_run_id()
    run_dir = make_run_dir(run_id, cfg.runs_dir)
    bind_run(run_id, cfg.runs_dir)
    raise_open_files("broker")  # before any socket: a descriptor per connection (runtime/fdlimit.py)
    host = hostname()
    lineage = {"parent_run": parent.run_id, "resumed_from": parent.summary()} if parent else {}
    try:
        broker = Broker(cfg, run_id, run_dir, host, parent)
    except (zmq.ZMQError, OSError) as e:  # OSError: the --metrics-port HTTP server
        log.error("broker.start_failed", error=str(e), port=cfg.port, data_in_port=cfg.data_in_port,
                  metrics_port=cfg.metrics_port)
        ports = f"{cfg.port}/{cfg.data_in_port}" + (f"/{cfg.metrics_port}" if cfg.metrics_port else "")
        click.echo(f"error: cannot bind ports {ports} on {cfg.bind}: {e}", err=True)
        close_logging()
        # No run was served: its folder would be one more empty run in runs/ per failed start
        # (the error is on stderr and in the JSON lines on stdout).
        shutil.rmtree(run_dir, ignore_errors=True)
        return 1
    runinfo.start(run_dir, run_id, as_dict(cfg), broker.endpoints, cfg.instance, **lineage)
    before = latest_run(cfg.runs_dir)
    point_latest(run_id, cfg.runs_dir)
    sink = None
    if cfg.tensorboard or cfg.wandb:
        from dflash.runtime.sinks import open_sinks

        sink = open_sinks(cfg.tensorboard, cfg.wandb, run_id, run_dir, "broker.progress")
        broker.core.use_metric_sink(sink)
    broker.core.set_meta(run_id=run_id, schema=SCHEMA_VERSION, seed=cfg.seed, epochs=cfg.epochs,
                         config=as_dict(cfg))
    security.warn_if_open(cfg.bind, bool(cfg.curve_keys))
    if parent is not None:
        log.info("broker.resume", **lineage["resumed_from"], left=resume.left_to_do(parent, cfg.epochs),
                 epochs=cfg.epochs, seed=cfg.seed)

    def on_signal(stop: GracefulStop) -> None:  # acted on by the loop, never here
        broker.signal, broker.signals = stop.signal_name, stop.count

    GracefulStop(hard_second=False, on_signal=on_signal).install()
    log.info("broker.start", config=as_dict(cfg), endpoints=broker.endpoints, run_dir=str(run_dir),
             io_threads=broker.io_threads, data_streams=broker.streams, producer_streams=broker.producer_streams)
    outcome, error = "crashed", None
    try:
        outcome = broker.serve()
    except StorageError as e:  # a full disk: said where it can be, no traceback
        outcome, error = "storage_failed", str(e)
        log.error("broker.storage_failed", error=error, hint=STORAGE_HINT)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        log.exception("broker.crashed", error=error)
    finally:
        summary = broker.core.summary()
        try:
            broker.close()
        except StorageError as e:  # the ledger's last flush, refused
            if error is None:
                outcome, error = "storage_failed", str(e)
                log.error("broker.storage_failed", error=error, hint=STORAGE_HINT)
        if sink is not None:
            sink.close()
        why = broker.outcome_why
        code = 1 if error is not None else EXIT_NOTHING_TO_TRAIN if outcome == "nothing_to_train" else 0
        try:
            runinfo.finish(run_dir, outcome, time.time(), samples=summary["samples"],
                           bad_batches=summary["bad_batches"], error=error, signal=broker.signal,
                           **({"reason": why} if why else {}))
        except OSError as e:  # even in place: run.json keeps "running" and status says no end recorded
            log.error("broker.storage_failed", error=f"cannot write {run_dir / 'run.json'}: {e.strerror or e}",
                      hint=STORAGE_HINT)
            error = error or f"cannot write {run_dir / 'run.json'}: {e.strerror or e}"
        if parent is None and summary["peer_messages"] == 0:
            # A fresh run no peer even tried to join holds nothing; `latest` goes back to the run
            # before it (RELIABILITY.md 10). A resumed one keeps it: it is where its chain goes on.
            give_back_latest(run_id, before, cfg.runs_dir)
        log.info("broker.exit", outcome=outcome, exit_code=code, latest=latest_run(cfg.runs_dir))
        close_logging()
    if outcome == "nothing_to_train":
        click.echo(f"error: nothing to train in run {run_id}: {why}", err=True)
    elif outcome == "storage_failed":
        click.echo(f"error: broker stopped run {run_id}: {error}; {STORAGE_HINT}", err=True)
    return code
