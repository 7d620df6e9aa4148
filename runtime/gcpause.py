"""Short garbage-collector pauses in long-lived processes.

A full collection after importing torch can hold the GIL for seconds, long enough for a peer to miss
heartbeats and be declared lost. `freeze_setup()` moves what is alive after setup into the permanent
generation, which collections skip.
"""

from __future__ import annotations

import gc


def freeze_setup() -> int:
    """Exempt what is alive now from later collections; returns how many objects are frozen."""
    gc.freeze()
    return gc.get_freeze_count()
