"""dflash-consume's command line: the options of the frozen `ConsumerConfig`'s fields and its
`TrainConfig`'s (process/config.py and training/config.py declare each once), made into one, then handed to
consumer_process.run. torch is imported only once the options are read (the process and what
it imports need it), so that `--help` answers at once.

    python -m dflash.consumers.process.consume_command --target Qwen/Qwen3-8B --broker tcp://host:5555
"""

from __future__ import annotations

from dflash.consumers.process.config import ConsumerConfig
from dflash.runtime.command_line import command, config_of, config_option, default_instance, fail, option, options


# The command's own option, no config field: it is made into ConsumerConfig.gpu (_gpu_of).
device_option = option("--device", default=None, help="Torch device instead of --gpu, as dflash-produce takes it: "
                       "'cpu', 'cuda' or 'cuda:N'.")


@command("CONSUME", max_content_width=100)
@config_option()
@options(ConsumerConfig, after={"gpu": [device_option], "fuse": ["inbox_bytes"]})
def main(**o) -> None:
    """Train a DFlash drafter on target hidden states (one data-parallel rank)."""
    if o["eval_prompts"] and not o["eval_every"]:  # refused before torch and the target load
        fail("--eval-prompts is used by the live evaluation: give --eval-every N too")
    if not o["synthetic_batches"]:
        from dflash.protocol.peer import dial_or_exit

        dial_or_exit(o["broker"], o["curve_keys"], o["curve_name"])  # a wrong --broker said before the target loads
    from .consumer_process import run
    from dflash.consumers.process.config import ConsumerConfig

    gpu = _gpu_of(o.pop("gpu"), o.pop("device"))
    instance = o.pop("instance") or default_instance("cpu" if gpu is None else f"cuda{gpu}")
    run(config_of(ConsumerConfig, {**o, "gpu": gpu, "instance": instance}))


def _gpu_of(gpu: int | None, device: str | None) -> int | None:
    """--gpu N or --device cpu|cuda|cuda:N as the CUDA index (None: CPU)."""
    if device is None:
        return gpu
    d = device.strip().lower()
    if d == "cpu":
        index = None
    elif d == "cuda" or d.startswith("cuda:") and d[5:].isdigit():
        index = int(d[5:]) if d[4:5] == ":" else 0
    else:
        fail(f"--device {device!r}: the consumer trains on 'cpu', 'cuda' or 'cuda:N'")
    if gpu is not None and gpu != index:
        fail(f"--gpu {gpu} and --device {device} name different devices: give one of them")
    return index


if __name__ == "__main__":
    main()
