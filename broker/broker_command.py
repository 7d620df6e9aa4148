"""dflash-broker's command line: the options, made into the frozen `BrokerConfig` (and the
parent run a `--resume` names), then handed to broker_process.run. The server is imported
only once the options are read, so that `--help` answers at once.

    python -m dflash.broker.broker_command --epochs 6 --consumers 2
"""

from __future__ import annotations

import sys

import click

from dflash.protocol.messages import MAX_MESSAGE_BYTES
from dflash.runtime.command_line import command, config_option, log_level_option, option, runs_dir_option


class Duration(click.ParamType):
    """600, 600s, 10m, 1h30m -> seconds (budget.parse_duration); click names the option on error."""

    name = "duration"

    def convert(self, value, param, ctx):
        from .budget import parse_duration

        try:
            return parse_duration(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


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
@option("--time-budget", default=None, type=Duration(), metavar="DURATION",
        help="End the run within this time from the broker's start (600, 600s, 10m, 1h30m): the broker plans the "
             "samples trained from the measured rate, so the consumers' lr anneals to --min-lr as the last planned "
             "sample is trained and everything trained is committed before the deadline (docs/TRAINING.md, "
             "\"A recipe for a time budget\"). Never more than --epochs over the dataset. Default: no budget.")
@option("--seed", default=0, type=int, help="Seed of the per-epoch sample order (same seed -> same order).")
@option("--queue-bytes", default="4GiB",
        help="Most batch bytes the shared queue holds; when full the broker stops reading producers (backpressure).")
@option("--max-message-bytes", default=str(MAX_MESSAGE_BYTES),
        help="Largest batch accepted (bytes, or e.g. 512MiB); larger ones are dropped and logged.")
@option("--heartbeat-s", default=1.0, type=float, help="Seconds between heartbeats the broker sends and expects.")
@option("--timeout-s", default=10.0, type=float,
        help="A peer silent this long is declared lost and its work requeued (keep it above one batch transfer).")
@option("--ack-timeout-s", default=0.0, type=float,
        help="A consumer holding delivered batches that acks none for this long is declared lost and its "
             "batches requeued (it heartbeats, so --timeout-s does not catch it). 0: auto, the larger of 120 s, "
             "12 x --timeout-s and 4 x that consumer's slowest gap between two acks.")
@option("--lease-size", default=256, type=int, help="Most samples handed to a producer per lease.")
@option("--quarantine-after", default=2, type=int,
        help="A batch that this many consumers fail on (each reports it and leaves) is quarantined: its samples "
             "are made again once, and set aside, counted by reason, if their new batch fails as well "
             "(docs/RELIABILITY.md, poison batches).")
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
@option("--tensorboard", default=None, metavar="DIR", type=click.Path(file_okay=False),
        help="Also write each broker.progress line's figures as TensorBoard scalars under DIR/<run_id>, named as "
        "the JSON fields (broker.progress/samples_per_s, broker.progress/queue_bytes), at the seconds since start; "
        "needs the tensorboard extra.")
@option("--wandb", default=None, metavar="PROJECT",
        help="Also log each broker.progress line's figures to Weights & Biases PROJECT (run <run_id>-broker, files "
        "in the run folder); WANDB_MODE=offline writes them locally only. Needs the wandb extra.")
@option("--metrics-port", default=0, type=int,
        help="Serve the status map as Prometheus text on http://BIND:PORT/metrics (0 = off).")
@log_level_option()
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
             "Consumers load the checkpoint of its last commit. Producers/consumers may number differently. "
             "A run another run resumed already is refused (resume the end of its chain).")
@option("--force-resume", is_flag=True, default=False,
        help="With --resume: resume RUN even though another run resumed it already, as a second branch from "
             "RUN's last commit (what the first continuation trained since is trained again, into another drafter).")
def main(**opts) -> None:
    """The dflash broker: creates a run, hands out work leases to producers, queues their
    hidden-state batches (bounded in bytes) and dispatches them to consumers by credit.

    Prints one JSON log line per event (key=value on a terminal) and writes the same to
    runs/<run_id>/logs/broker-<instance>.jsonl. See docs/PROTOCOL.md and docs/LOGS.md.
    """
    cfg, parent = broker_config(opts)
    from .broker_process import run

    sys.exit(run(cfg, parent))


def broker_config(opts: dict):
    """(BrokerConfig, the resumed parent run or None) of the command's options; a bad option
    exits 2 with a one-line reason naming it."""
    from dflash.protocol import curve
    from dflash.runtime.command_line import fail

    from . import resume
    from .config import BrokerConfig, parse_bytes, parse_port_range

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
            parent = resume.load(cfg.resume, cfg.runs_dir, again=cfg.force_resume)
            cfg = resume.effective_config(cfg, parent, _explicit(("seed", "epochs", "num_samples")))
        elif cfg.force_resume:
            raise ValueError("--force-resume goes with --resume RUN")
        cfg.check()
        if cfg.tensorboard or cfg.wandb:
            from dflash.runtime.sinks import require_tensorboard, require_wandb

            if cfg.tensorboard:
                require_tensorboard()
            if cfg.wandb:
                require_wandb()
    except (ValueError, TypeError, curve.CurveKeyError) as e:  # resume.ResumeError is a ValueError
        fail(str(e))
    return cfg, parent


def _explicit(names: tuple[str, ...]) -> set[str]:
    """Which of `names` the user set (command line, env var or --config), not defaults."""
    ctx = click.get_current_context()
    return {n for n in names if ctx.get_parameter_source(n) is not click.core.ParameterSource.DEFAULT}


if __name__ == "__main__":
    main()
