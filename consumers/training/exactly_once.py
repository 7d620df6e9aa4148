"""The training loop's side of exactly-once (docs/RELIABILITY.md): leave out samples the
weights already hold, gather every rank's samples of a step, and add a committed step's
samples to the record (checkpoints/record.py), which is the truth of what the weights saw.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dflash.consumers.parallel.dist import Dist
from dflash.runtime.logs import get_logger

from dflash.protocol.batch import Batch

if TYPE_CHECKING:
    from .train_config import TrainState

log = get_logger()


def drop_held(batch: Batch, state: TrainState) -> Batch | None:
    """`batch` without the sequences the weights already hold (None if all): a crash can lose an
    ack, and a resumed run makes the sample again. They are still acked: they are in the weights."""
    held = [i for i, s in enumerate(batch.samples) if state.record.holds(batch.epoch, s)]
    if not held:
        return batch
    log.info("train.skip_held", batch_id=batch.batch_id, epoch=batch.epoch, step=state.step,
             samples=[batch.samples[i] for i in held[:16]], n=len(held), of=len(batch.samples))
    if len(held) == len(batch.samples):
        return None
    drop = set(held)
    return batch.select([i for i in range(len(batch.samples)) if i not in drop])


def gather_samples(dist: Dist, batch: Batch | None, n_all: int) -> list[tuple[int, int]]:
    """Every rank's (epoch, sample) pairs of this step (one all_gather of at most `n_all` each)."""
    if not dist.enabled:  # only ours: no collective, no tensor
        return [(int(batch.epoch), int(s)) for s in batch.samples] if batch is not None else []
    mine = torch.tensor([[batch.epoch, s] for s in batch.samples] if batch is not None else [],
                        dtype=torch.int64).reshape(-1, 2)
    return list(map(tuple, dist.gather_rows(mine, n_all).tolist()))


def record_samples(state: TrainState, dist: Dist, pairs: list[tuple[int, int]], step: int) -> None:
    """This (committed) step's pairs into the record: only a step that is applied counts."""
    again = state.record.add(pairs)
    if again:  # a sample the weights had already seen: exactly-once is broken somewhere
        log.error("train.sample_repeated", step=step, rank=dist.rank, n=len(again),
                  pairs=[list(x) for x in again[:16]], repeats=state.record.repeats)
