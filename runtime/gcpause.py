"""Short garbage-collector pauses in long-lived processes.

A full pass of Python's cyclic collector walks every tracked object with the GIL held.
After importing torch and transformers a process tracks hundreds of thousands of them, so
on a loaded host a pass can hold the GIL for seconds: a peer's I/O thread sends no
heartbeat meanwhile, and the broker (one thread) sends none and reads none. The soak saw
consumers declared lost right after checkpoints, whose allocations set off such a pass.
`freeze_setup()` moves every object alive now (modules, the model, the target) into the
permanent generation, which collections skip; what the loop allocates later is collected
as before. Call it once setup is done, again after more setup.
"""

from __future__ import annotations

import gc


def freeze_setup() -> int:
    """Exempt what is alive now from later collections; returns how many objects are frozen."""
    gc.freeze()
    return gc.get_freeze_count()
