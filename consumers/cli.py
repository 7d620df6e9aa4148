"""dflash-consume: train the DFlash drafter on the batches handed to this consumer.

    dflash-consume --gpu 5 --target Qwen/Qwen3-8B --broker tcp://host:5555

`main` is the click command (command.py: options onto `ConsumerConfig`); `run` is one
consumer process (consumer.py). `python -m dflash.consumers.cli` runs the command.
"""

from .command import main
from .consumer import ConsumerConfig, run

__all__ = ["ConsumerConfig", "main", "run"]

if __name__ == "__main__":
    main()
