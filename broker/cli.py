"""`dflash-broker`: create a run and serve it until end of stream or a signal.

Exit status: 0 when the run completed (every consumer said bye after `stop`) or was
stopped by SIGINT/SIGTERM after a clean shutdown (run.json says which); 2 on bad
options; 1 if the broker could not start (e.g. a port in use) or crashed.
"""

from __future__ import annotations

import shutil
import sys

import click
import zmq

from dflash.runtime.alloc import reuse_freed_memory
from dflash.protocol import curve
from dflash.runtime.config import as_dict, fail
from dflash.runtime.logs import bind_run, close_logging, get_logger, setup_logging
from dflash.runtime.run import hostname, make_run_dir, new_run_id, point_latest
from dflash.runtime.stop import GracefulStop

from . import resume, runinfo, security
from .config import BrokerConfig, parse_bytes, parse_port_range
from .ledger import SCHEMA_VERSION
from .server import Broker


def start(opts: dict) -> None:
    """dflash-broker with its options (command.py parses them)."""
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
        if cfg.tensorboard or cfg.wandb:
            from dflash.runtime.sinks import require_tensorboard, require_wandb

            if cfg.tensorboard:
                require_tensorboard()
            if cfg.wandb:
                require_wandb()
    except (ValueError, TypeError, curve.CurveKeyError) as e:  # resume.ResumeError is a ValueError
        fail(str(e))
    sys.exit(run(cfg, parent))


def _explicit(names: tuple[str, ...]) -> set[str]:
    """Which of `names` the user set (command line, env var or --config), not defaults."""
    ctx = click.get_current_context()
    return {n for n in names if ctx.get_parameter_source(n) is not click.core.ParameterSource.DEFAULT}


def run(cfg: BrokerConfig, parent: resume.Parent | None = None) -> int:
    """Create the run, serve it, record the outcome. Returns the exit status."""
    reuse_freed_memory()  # before ZeroMQ starts its I/O threads: see runtime/alloc.py
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
        ports = f"{cfg.port}/{cfg.data_in_port}" + (f"/{cfg.metrics_port}" if cfg.metrics_port else "")
        click.echo(f"error: cannot bind ports {ports} on {cfg.bind}: {e}", err=True)
        close_logging()
        # No run was served: its folder would be one more empty run in runs/ per failed start
        # (the error is on stderr and in the JSON lines on stdout).
        shutil.rmtree(run_dir, ignore_errors=True)
        return 1
    runinfo.start(run_dir, run_id, as_dict(cfg), broker.endpoints, cfg.instance, **lineage)
    point_latest(run_id, cfg.runs_dir)
    if cfg.tensorboard or cfg.wandb:
        from dflash.runtime.sinks import open_sinks

        broker.metric_sink = open_sinks(cfg.tensorboard, cfg.wandb, run_id, run_dir, "broker.progress")
    broker.ledger.set_meta(run_id=run_id, schema=SCHEMA_VERSION, seed=cfg.seed, epochs=cfg.epochs,
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
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        log.exception("broker.crashed", error=error)
    finally:
        samples = dict(broker.ledger.counts)
        bad_batches = broker.core.poison.as_dict()
        broker.close()
        if getattr(broker, "metric_sink", None) is not None:
            broker.metric_sink.close()
        why = getattr(broker, "outcome_why", None)
        code = 1 if error is not None else EXIT_NOTHING_TO_TRAIN if outcome == "nothing_to_train" else 0
        runinfo.finish(run_dir, outcome, samples=samples, bad_batches=bad_batches, error=error, signal=broker.signal,
                       **({"reason": why} if why else {}))
        log.info("broker.exit", outcome=outcome, exit_code=code)
        close_logging()
    if outcome == "nothing_to_train":
        click.echo(f"error: nothing to train in run {run_id}: {why}", err=True)
    return code


# A run that reached end of stream without training anything: not a success (issue 19).
EXIT_NOTHING_TO_TRAIN = 3


from .command import main  # noqa: E402  (the click command; `dflash.broker.cli:main` as before)

if __name__ == "__main__":
    main()
