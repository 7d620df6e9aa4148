"""Each epoch's shuffled sample order, from the run's seed (PROTOCOL.md 4.3): the broker
leases samples along it (broker/leases.py), and a producer that regenerates ahead works
along epoch 0's from the welcome's `seed` and `dataset.n_samples` (producers/broker_work.py), so
both must compute the very same order.
"""

from __future__ import annotations

import random


def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    """The shuffled sample order of `epoch`: the same for the same (seed, epoch, n).

    A str seed is hashed with SHA-512 by `random.Random`, stable across Python versions.
    """
    order = list(range(n))
    random.Random(f"dflash:{seed}:{epoch}").shuffle(order)
    return order
