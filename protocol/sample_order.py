"""Each epoch's shuffled sample order from the run's seed (PROTOCOL.md 4.3): the broker leases along
it and a producer working ahead computes the very same one."""

from __future__ import annotations

import random


def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    """The shuffled order of `epoch`, stable across Python versions (a str seed is hashed with SHA-512)."""
    order = list(range(n))
    random.Random(f"dflash:{seed}:{epoch}").shuffle(order)
    return order
