"""What `train()` gets from the broker's link once a consumer has joined (join.py), as
producers/broker_work.py is the producer's policy on its link (protocol/links.py `ConsumerLink`):
the batch iterator, the hooks (ack, commit, figures, heartbeat) and the failure report."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator

import torch

from dflash.consumers.training.batch import BatchMismatch
from dflash.consumers.training.train_config import Hooks, TrainState
from dflash.protocol.messages import Failed
from dflash.runtime.gpu import gpu_figures
from dflash.runtime.logs import get_logger

log = get_logger()

BATCH_WAIT_S = 0.5  # a starved rank delays a peer's step little; idle ranks meet twice a second, not spin
PLAN_WAIT_BEATS = 3  # heartbeat intervals the first step waits for the run's planned samples


def failure(e: BaseException) -> Failed:
    """What a consumer stopping on `e` tells the broker (PROTOCOL.md 4.2); a batch at fault is named
    so the broker can quarantine it, and a restarted consumer does not die on it forever."""
    if isinstance(e, BatchMismatch) and e.batch_id is not None:
        return Failed("bad_batch", str(e)[:2000], batch_id=e.batch_id, fault=e.fault,
                      hint="restart this consumer: the broker quarantines a batch every consumer fails on "
                           "(dflash-broker --quarantine-after)")
    return Failed("error", f"{type(e).__name__}: {str(e)[:2000]}")


def nothing_left_to_train(link, error: FileNotFoundError) -> TrainState:
    """A consumer that joined as the run ended (its checkpoint pruned, the stream over); else re-raises."""
    if not (link.stopped.is_set() and link.stop_reason == "end_of_stream"):
        raise error
    log.warning("consume.nothing_to_train", reason=str(error)[:300])
    return TrainState(end_reason="end_of_stream")


def broker_batches(link, stop: threading.Event, wait_s: float = BATCH_WAIT_S) -> Iterator:
    """Batch messages for `train()`, None when nothing came within `wait_s`, until the stream's end;
    a shutdown sets `stop` (untrained batches go back to the broker's queue)."""
    while True:
        if link.stopped.is_set() and link.stop_reason != "end_of_stream":
            stop.set()
            return
        msg = link.next_batch(timeout_s=wait_s)
        if msg is None and link.stopped.is_set() and link.prefetched() == 0:
            if link.stop_reason == "end_of_stream":
                return
            continue  # shutdown: handled at the top
        yield msg


class BrokerHooks:
    """`train()` hooks wired to the link."""

    def __init__(self, link, rank: int, stop: threading.Event, device: torch.device, resumed_from: str | None = None):
        self.link, self.rank, self.device = link, rank, device
        self.resumed_from = resumed_from
        self.stats: dict = {"state": "starting", "rank": rank}
        self.last_commit: tuple[int, str, bool] | None = None  # step, path, sent after stop
        self.lineage: str | None = None  # of the weights: named in every ack and commit (checkpoints/record.py)
        self.acked_step: int | None = None
        self.hooks = Hooks(on_step=self.on_step, on_checkpoint=self.on_checkpoint, queue=self.queue,
                           progress=self.progress, plan=self.plan, budget_progress=self.budget_progress,
                           stop=stop, stats=self.stats,
                           on_lineage=self.on_lineage, resume_point=self.resume_point)
        self.plan_waited = False

    def on_lineage(self, record) -> None:
        """The weights' lineage; a new one is announced before any ack names it. A replica healed into a
        running lineage announces it too: the broker takes commits only from a lineage's announced or
        batch-acking consumers, and a healed rank 0 may save before it trains a batch (or with none left)."""
        if record.lineage != self.lineage:
            msg = record.lineage_message(self.resumed_from)
            log.info("consume.lineage", **msg.fields(), origin=record.origin)
            self.link.send_control(msg)
            self.acked_step = None  # acks of other weights do not count for this lineage's commits
        self.lineage = record.lineage

    def resume_point(self) -> str | None:
        last = (self.link.broker_stats or {}).get("last_commit")
        checkpoint = last.get("checkpoint") if isinstance(last, dict) else None
        self.resumed_from = checkpoint or self.resumed_from
        return checkpoint

    def on_step(self, step: int, batch_ids: list[str]) -> None:
        self.link.ack(batch_ids, step, self.lineage)
        self.acked_step = step

    def on_checkpoint(self, step: int, path) -> None:
        path = str(Path(path).resolve())  # a resumed run's consumers load it from any cwd
        if self.acked_step is None or self.acked_step < step:
            # a commit is taken only of a step its sender acked (PROTOCOL.md 4.5): ack it empty
            self.link.ack([], step, self.lineage)
            self.acked_step = step
        self.link.commit(step, path, self.lineage)
        self.last_commit = (step, path, self.link.stopped.is_set())

    def commit_final(self, step: int) -> None:
        """Commit the last checkpoint again if it went out before `stop`: other ranks' acks may
        have arrived after it, and `stop` comes only after every ack."""
        if self.last_commit and self.last_commit[0] == step and not self.last_commit[2]:
            log.info("consume.commit_again", step=step, checkpoint=self.last_commit[1])
            self.on_checkpoint(step, self.last_commit[1])

    def queue(self) -> dict:
        s = self.link.broker_stats
        return {"q_pre": s.get("q_pre") or {}, "q_hs": s.get("queue_batches"), "prefetched": self.link.prefetched()}

    def progress(self) -> dict:
        """The heartbeat's run counts, with `samples_planned`: what the ETA counts down to."""
        return {**self.link.broker_stats, "samples_planned": self._planned(self.link)}

    def plan(self) -> int | None:
        """The broker's planned samples less those skipped; the first call waits a few heartbeats
        for it rather than start the run without a plan."""
        link = self.link
        if self._planned(link) is None and not self.plan_waited:
            self.plan_waited = True
            deadline = time.monotonic() + PLAN_WAIT_BEATS * link.welcome.heartbeat_s
            while self._planned(link) is None and time.monotonic() < deadline:
                time.sleep(0.02)
        total, stats = self._planned(link), link.broker_stats
        return None if total is None else max(0, int(total) - int(stats.get("samples_skipped") or 0))

    def budget_progress(self) -> float | None:
        return getattr(self.link, "broker_progress", None)

    @staticmethod
    def _planned(link) -> int | None:
        """The heartbeat's planned_samples, else (an older broker) its samples_total."""
        plan = getattr(link, "broker_plan", None)
        return plan if plan is not None else link.broker_stats.get("samples_total")

    def heartbeat(self) -> dict:
        """Heartbeat stats, on the link's I/O thread: a C-level dict copy, never iterating a live dict."""
        out = dict(self.stats)
        out["prefetched"] = self.link.prefetched()
        out.update(gpu_figures(self.device))
        return out
