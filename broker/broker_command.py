"""dflash-broker's command line: `BrokerConfig`'s options made into one and handed to broker_process.run
(the server is imported only after parsing, so `--help` answers at once)."""

from __future__ import annotations

import sys

import click

from dflash.runtime.command_line import command, config_option, options, parse_texts

from .config import BrokerConfig


@command("BROKER", max_content_width=100)
@config_option()
@options(BrokerConfig, parse=False)  # sizes and the port range are parsed in broker_config: a one-line error
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
    """(BrokerConfig, the resumed parent or None); a bad option exits 2 with a one-line reason."""
    from dflash.protocol import curve
    from dflash.runtime.command_line import fail

    from . import resume

    parent = None
    try:
        cfg = BrokerConfig(**parse_texts(BrokerConfig, opts, "BROKER"))
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
