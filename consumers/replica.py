"""The elastic replica-state hand-over (elastic.py): what a healthy replica serves a
joining or lagging one, and how that one takes it (a heal).

The training loop registers these two with its `Dist`; the quorum compares steps to
decide who heals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash.protocol.logs import get_logger

from .checkpoint import Signal, SignalMismatch, signal_differences
from .dist import Dist
from .record import TrainedRecord

if TYPE_CHECKING:
    from .train_config import TrainState

log = get_logger()


def replica_state(model, optimizer, state: TrainState, signal: Signal) -> dict:
    """What a healthy replica hands a joining one (elastic.py): everything the next step
    depends on. Tensors are the live ones; torchft serves them before this replica's next
    optimizer step."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "signal": signal.as_dict(),
            "counters": {"step": state.step, "tokens": state.tokens, "samples": state.samples,
                         "epoch": state.epoch, "saved_step": state.saved_step},
            "record": state.record.to_state()}


def take_replica_state(got: dict, model, optimizer, state: TrainState, signal: Signal, dist: Dist) -> None:
    """Heal: replace our state with a healthy replica's. Raises SignalMismatch when it
    trains another signal (this consumer was started with other options)."""
    diffs = signal_differences(got["signal"], signal)
    if diffs:
        raise SignalMismatch(f"the running consumers train another signal ({'; '.join(diffs)}): start every "
                             "consumer of a run with the same training options")
    before = state.step
    model.load_state_dict(got["model"])
    optimizer.load_state_dict(got["optimizer"])
    c = got["counters"]
    state.step, state.tokens, state.samples, state.epoch = c["step"], c["tokens"], c["samples"], c["epoch"]
    state.saved_step = c["saved_step"]
    state.record = TrainedRecord.from_state(got["record"])
    # torchft heals every replica but one at each quorum until a first step is taken
    # (init_sync): log the heals that change something.
    level = log.info if state.step != before else log.debug
    level("train.healed", step=state.step, previous_step=before, samples=state.samples,
          record_samples=state.record.count(), rank=dist.rank)
