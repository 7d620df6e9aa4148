"""What `train()` gets from the broker's link once a consumer has joined (join.py), as
producers/broker_work.py is the producer's policy on its link (protocol/links.py `ConsumerLink`:
inbox, credit, acks, commits):

- `broker_batches`: the batch iterator `train()` reads: a message, None when nothing came
  in time (an empty step or a wait, never a hang), the end at `stop` once drained;
- `BrokerHooks`: ack after each step, commit after each checkpoint (rank 0), the queue
  and progress figures each `train.step` logs, the heartbeat's stats;
- `nothing_left_to_train`: a consumer that joined as the run ended;
- `failure`: what a consumer that stops on an error tells the broker (`failed`), naming the
  batch when the batch is at fault.
"""

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

# How long a rank waits for a batch before it reports "nothing now" to the step's
# collective. Short enough that a starved rank delays a peer's step little; long enough
# that ranks with nothing to do meet about twice a second rather than spinning.
BATCH_WAIT_S = 0.5
# How many broker heartbeat intervals the first step waits for the run's planned samples.
PLAN_WAIT_BEATS = 3


def failure(e: BaseException) -> Failed:
    """What a consumer that stops on `e` tells the broker before its `bye` (PROTOCOL.md 4.2).
    A batch at fault is named: the broker requeues it and quarantines it once it has failed
    --quarantine-after consumers, so a restarted consumer does not die on it forever."""
    if isinstance(e, BatchMismatch) and e.batch_id is not None:
        return Failed("bad_batch", str(e)[:2000], batch_id=e.batch_id, fault=e.fault,
                      hint="restart this consumer: the broker quarantines a batch every consumer fails on "
                           "(dflash-broker --quarantine-after)")
    return Failed("error", f"{type(e).__name__}: {str(e)[:2000]}")


def nothing_left_to_train(link, error: FileNotFoundError) -> TrainState:
    """A consumer that joined as the run ended: the checkpoint its welcome named was pruned
    (rank 0 kept checkpointing) before it loaded it, and the stream is over, so there is
    nothing to train and no state to load. Anything else re-raises `error`."""
    if not (link.stopped.is_set() and link.stop_reason == "end_of_stream"):
        raise error
    log.warning("consume.nothing_to_train", reason=str(error)[:300])
    return TrainState(end_reason="end_of_stream")


def broker_batches(link, stop: threading.Event, wait_s: float = BATCH_WAIT_S) -> Iterator:
    """Batch messages for `train()`: None when nothing came within `wait_s`; returns at
    end of stream (the broker sends `stop` only once every delivered batch is acked, so
    the inbox is empty by then). A `stop` for another reason (the broker shuts down)
    sets `stop`: save what we have and leave; batches not trained go back to its queue.
    Raises what the link raises (BrokerLost, Rejected)."""
    while True:
        if link.stopped.is_set() and link.stop_reason != "end_of_stream":
            stop.set()
            return
        msg = link.next_batch(timeout_s=wait_s)  # sleeps in a queue wait: no busy loop
        if msg is None and link.stopped.is_set() and link.prefetched() == 0:
            if link.stop_reason == "end_of_stream":
                return
            continue  # shutdown: handled at the top
        yield msg


class BrokerHooks:
    """`train()` hooks wired to the link; `stats` is what the heartbeat reports."""

    def __init__(self, link, rank: int, stop: threading.Event, device: torch.device, resumed_from: str | None = None):
        self.link, self.rank, self.device = link, rank, device
        self.resumed_from = resumed_from  # the checkpoint a new lineage starts from, for the broker's log
        self.stats: dict = {"state": "starting", "rank": rank}
        self.last_commit: tuple[int, str, bool] | None = None  # step, path, sent after stop
        self.lineage: str | None = None  # of the weights: named in every ack and commit (checkpoints/record.py)
        self.acked_step: int | None = None  # the newest step acked
        self.hooks = Hooks(on_step=self.on_step, on_checkpoint=self.on_checkpoint, queue=self.queue,
                           progress=self.progress, plan=self.plan, budget_progress=self.budget_progress,
                           stop=stop, stats=self.stats,
                           on_lineage=self.on_lineage, resume_point=self.resume_point)
        self.plan_waited = False

    def on_lineage(self, record) -> None:
        """The weights' lineage from now on; a new one (not a heal's) is announced before
        any ack names it, so the broker sends back to the pool what these weights lack."""
        if record.origin != "healed" and record.lineage != self.lineage:
            msg = record.lineage_message(self.resumed_from)
            log.info("consume.lineage", **msg.fields(), origin=record.origin)
            self.link.send_control(msg)
        if record.lineage != self.lineage:
            self.acked_step = None  # acks of other weights do not count for this lineage's commits
        self.lineage = record.lineage

    def resume_point(self) -> str | None:
        """The broker's newest commit as its latest heartbeat tells it (None: none yet)."""
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
            # this rank had no batch in the steps up to this one: the broker takes a commit
            # only of a step its sender acked (PROTOCOL.md 4.5), so ack the step with none
            self.link.ack([], step, self.lineage)
            self.acked_step = step
        self.link.commit(step, path, self.lineage)
        self.last_commit = (step, path, self.link.stopped.is_set())

    def commit_final(self, step: int) -> None:
        """Commit the last step's checkpoint again if it went out before `stop`.

        Other ranks ack that step on their own connections, which may reach the broker
        after rank 0's commit; those samples would stay `trained`. `stop` comes only
        after every ack, so a commit sent after it covers them all."""
        if self.last_commit and self.last_commit[0] == step and not self.last_commit[2]:
            log.info("consume.commit_again", step=step, checkpoint=self.last_commit[1])
            self.on_checkpoint(step, self.last_commit[1])

    def queue(self) -> dict:
        """The field report's queue depths: q_pre per producer, q_hs the shared queue,
        and this consumer's own prefetched batches."""
        s = self.link.broker_stats
        return {"q_pre": s.get("q_pre") or {}, "q_hs": s.get("queue_batches"), "prefetched": self.link.prefetched()}

    def progress(self) -> dict:
        return self.link.broker_stats

    def plan(self) -> int | None:
        """The samples this run plans to train: the broker's planned_samples (--time-budget's
        plan, else epochs x samples) less those skipped (bad rows: never trained), from its
        heartbeat.

        A batch exists only once a producer fixed the dataset size, and the broker's next
        heartbeat carries it: the first call (the first step) waits for that heartbeat
        (a few heartbeat intervals at most) rather than start the run without a plan."""
        link = self.link
        if self._planned(link) is None and not self.plan_waited:
            self.plan_waited = True
            deadline = time.monotonic() + PLAN_WAIT_BEATS * link.welcome.heartbeat_s
            while self._planned(link) is None and time.monotonic() < deadline:
                time.sleep(0.02)
        total, stats = self._planned(link), link.broker_stats
        return None if total is None else max(0, int(total) - int(stats.get("samples_skipped") or 0))

    def budget_progress(self) -> float | None:
        """--time-budget: the share of the run's training time gone, from the broker's last
        heartbeat (None without a budget)."""
        return getattr(self.link, "broker_progress", None)

    @staticmethod
    def _planned(link) -> int | None:
        """The heartbeat's planned_samples (--time-budget's plan, else epochs x samples); a
        broker that does not send it: its samples_total."""
        plan = getattr(link, "broker_plan", None)
        return plan if plan is not None else link.broker_stats.get("samples_total")

    def heartbeat(self) -> dict:
        """Heartbeat stats (PROTOCOL.md 4.2). Runs on the link's I/O thread: a C-level
        dict copy, never iteration over a dict the training thread updates."""
        out = dict(self.stats)
        out["prefetched"] = self.link.prefetched()
        out.update(gpu_figures(self.device))  # memory (+ utilisation with NVML); {} on CPU; never raises
        return out
