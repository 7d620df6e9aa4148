"""dflash-produce's command line: the options of the frozen `ProducerConfig`'s fields
(producer_config.py declares each once), made into one, then handed to producer_process.run.
torch is imported only once the options are read (the process and what it imports need it),
so that `--help` answers at once.

    python -m dflash.producers.produce_command --target Qwen/Qwen3-8B --data chats.jsonl
"""

from __future__ import annotations

import os

from dflash.runtime.command_line import command, config_option, fail, options

from .producer_config import ProducerConfig


@command("PRODUCE")
@config_option()
@options(ProducerConfig)
def main(**kw) -> None:
    """Run a frozen target model on leased samples and stream hidden states to the broker."""
    cfg = ProducerConfig(**kw)
    try:  # options that cannot work together are refused now, not after torch and the target load
        cfg.check()
    except ValueError as e:
        fail(str(e))
    if not cfg.dry_run and (not cfg.tensor_parallel or os.environ.get("RANK", "0") == "0"):
        from dflash.protocol.peer import dial_or_exit

        dial_or_exit(cfg.broker, cfg.curve_keys, cfg.curve_name)  # a wrong --broker said before the target loads
    from .producer_process import run

    run(cfg)


if __name__ == "__main__":
    main()
