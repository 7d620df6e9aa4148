"""The drafter training loop: `Trainer` holds one run's model, optimizer and state;
`Trainer.step` is one optimizer step, readable top to bottom (schedule, forward/backward,
all-reduce, commit decision, clip, optimizer step, ack, log, checkpoint, commit);
`state_dict`/`load_state_dict` are the one form of the state that checkpoints
(train_checkpoint.py) and elastic heals (parallel/elastic.py) carry. Its config, hooks,
state and schedules are in train_config.py.

The loop knows nothing about the network: it reads `batches` (None: nothing arrived in time)
and calls `Hooks` (ack, commit). Every rank runs it; ranks agree each step whether anyone has data."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Iterator

import torch

from dflash.consumers.checkpoints.record import TrainedRecord
from dflash.consumers.drafter import fused
from dflash.consumers.drafter.loss import LossStats
from dflash.consumers.drafter.mask_token import mask_in_batch
from dflash.consumers.drafter.model import (DFlashDraft, DrafterConfig, calibrate_features, copy_target_layers,
                                            init_layer_ids, published_config)
from dflash.consumers.parallel.dist import Dist, DistGroup
from dflash.protocol.training_signal import SignalMismatch, signal_differences
from dflash.runtime.gcpause import freeze_setup
from dflash.runtime.logs import get_logger
from dflash.runtime.target_heads import TargetHeads
from dflash.runtime.target_layers import load_target_layers

from . import finite, train_checkpoint
from .batch import BatchMismatch, check_fit
from dflash.protocol.batch import Batch
from .exactly_once import drop_held, gather_samples, record_samples
from .staging import BatchStager
from .step import StepPlan, forward_backward, plan_step
from .step_metrics import Meter, StepFigures
from .step_oom import OomInjection, StepSplitter
from .train_config import Hooks, Plan, TrainState, choose_plan, lr_at, noise_at, progress, resolve_signal
from dflash.consumers.training.config import TrainConfig


log = get_logger()

# Elastic start: an all-new quorum short of --consumers N waits this long for the rest; a later joiner never does.
START_WAIT_S = 60.0
START_POLL_S = 0.5  # else ranks waiting at the start spin through quorums as fast as the lighthouse answers


# ---------------------------------------------------------------- the loop


def train(
    cfg: TrainConfig,
    heads: TargetHeads,
    batches: Iterable,
    *,
    dist: DistGroup | None = None,
    ckpt_root: Path | None = None,
    runs_dir: str | Path | None = None,
    run_config: dict | None = None,
    hooks: Hooks | None = None,
) -> TrainState:
    """Train until the stream ends, `max_steps`, or `hooks.stop`; the final state. Raises
    SignalMismatch, BatchMismatch (after checkpointing what was trained), ValueError."""
    trainer = Trainer(cfg, heads, dist or Dist(), hooks or Hooks(), ckpt_root, run_config)
    trainer.join_or_resume(runs_dir)
    trainer.announce()
    return trainer.run(batches)


_STEP, _SKIP, _END = "step", "skip", "end"  # what the ranks agreed a step is (Trainer.agree)


class Trainer:
    """One run's model, optimizer and loop state (module docstring)."""

    def __init__(self, cfg: TrainConfig, heads: TargetHeads, dist: DistGroup, hooks: Hooks,
                 ckpt_root: Path | None, run_config: dict | None):
        self.cfg, self.heads, self.dist, self.hooks = cfg, heads, dist, hooks
        self.ckpt_root, self.run_config = ckpt_root, run_config
        self.device = device = heads.embed.device
        self.signal = resolve_signal(cfg, heads)
        # auto: compiled flex and fused kernels on GPU, faster than SDPA even with new shapes each step
        compiled = "auto" in (cfg.attn, cfg.fuse) and auto_compiles(device)  # asked (and warned) only for auto
        self.backend = cfg.attn if cfg.attn != "auto" else ("flex" if compiled else "sdpa")
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
        fused.enable(cfg.fuse == "on" or (cfg.fuse == "auto" and compiled))
        self._build_model()
        self.state = TrainState()
        torch.manual_seed(cfg.seed + 1 + dist.rank)  # anything random besides the seeded noise and anchors
        self.quorum_begun = False  # the next step's quorum was begun already (elastic, before the resume)
        self.mask_warned = False

    def _build_model(self) -> None:
        cfg, device = self.cfg, self.device
        # fp32 master weights, same init on every rank, then rank 0's copy everywhere
        torch.manual_seed(cfg.seed)
        self.mcfg = DrafterConfig.from_target(self.heads.spec, cfg.draft_layers, len(self.signal.target_layers))
        self.model = DFlashDraft(self.mcfg).to(device)
        if cfg.draft_init != "random":
            self._init_from_target()
        self.dist.broadcast_params(self.model)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           fused=device.type == "cuda")
        self.splitter = StepSplitter(self.params, device, inject=OomInjection.from_env())
        signal = self.signal
        self.drafter_json = published_config(self.mcfg, self.heads.spec, block_size=signal.block_size,
                                             mask_token_id=signal.mask_token_id,
                                             target_layer_ids=list(signal.target_layers))

    def _init_from_target(self) -> None:
        """--draft-init first|last: the draft layers start as copies of target layers. Before any resume
        or heal, which then replaces them: only a fresh run starts from these."""
        heads, mode = self.heads, self.cfg.draft_init
        ids = init_layer_ids(mode, self.cfg.draft_layers, heads.spec.num_hidden_layers)
        text = heads.config.get("text_config") or heads.config  # a multimodal wrapper's decoder
        kept = copy_target_layers(self.model, load_target_layers(heads.path, ids, device=self.device),
                                  text.get("hidden_act"))
        log.info("train.draft_init", mode=mode, target_layers=ids, target_layer_count=heads.spec.num_hidden_layers,
                 kept=kept, rank=self.dist.rank)

    # ------------------------------------------------ the state (checkpoints and heals)

    def state_dict(self) -> dict:
        """Everything the next step depends on: served live to a joining replica, or written by a checkpoint."""
        s = self.state
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "signal": self.signal.as_dict(),
                "counters": {"step": s.step, "tokens": s.tokens, "samples": s.samples, "epoch": s.epoch,
                             "saved_step": s.saved_step},
                "record": s.record.to_state()}

    def load_state_dict(self, sd: dict) -> None:
        """Take a `state_dict()` in place; the caller has compared its signal with ours."""
        state, c = self.state, sd["counters"]
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        state.step, state.tokens, state.samples, state.epoch = c["step"], c["tokens"], c["samples"], c["epoch"]
        state.saved_step = c["saved_step"]
        state.record = TrainedRecord.from_state(sd["record"])

    def _heal(self, sd: dict) -> None:
        """Heal (elastic): take a healthy replica's state; SignalMismatch if it trains another signal."""
        diffs = signal_differences(sd["signal"], self.signal)
        if diffs:
            raise SignalMismatch(f"the running consumers train another signal ({'; '.join(diffs)}): start every "
                                 "consumer of a run with the same training options")
        before = self.state.step
        self.load_state_dict(sd)
        state = self.state
        # torchft heals all but one replica at each quorum until a first step: log those that change something
        level = log.info if state.step != before else log.debug
        level("train.healed", step=state.step, previous_step=before, samples=state.samples,
              record_samples=state.record.count(), rank=self.dist.rank)

    # ------------------------------------------------ before the first step

    def join_or_resume(self, runs_dir: str | Path | None) -> None:
        """Take the state to start from: a running replica's (elastic), else the checkpoint's."""
        dist, state = self.dist, self.state
        # the first quorum comes before the resume: a joiner is healed from a live replica (its
        # checkpoint may be pruned by now, and is older anyway)
        dist.register_state(self.state_dict, self._heal)
        self.quorum_begun = dist.elastic
        if self.quorum_begun:
            dist.begin_step()
        if not dist.elastic:  # a fixed group's ranks are one set of weights: rank 0's lineage
            state.record.lineage = dist.broadcast_str(state.record.lineage)
        if dist.elastic and state.step == 0 and self.hooks.resume_point is not None:  # not healed: the newest commit
            self.cfg = replace(self.cfg, resume=self.hooks.resume_point() or self.cfg.resume)
        if self.cfg.resume and state.step == 0:  # not healed to a live step
            train_checkpoint.resume(self, runs_dir)
            dist.set_step(state.step)
        self.lineage_told = None
        self._tell_lineage()

    def _tell_lineage(self) -> None:
        if self.state.record is not self.lineage_told and self.hooks.on_lineage is not None:
            self.hooks.on_lineage(self.state.record)
        self.lineage_told = self.state.record

    def announce(self) -> None:
        freeze_setup()  # the model, optimizer and their imports: no full GC pass over them (gcpause.py)
        signal, dist, state = self.signal, self.dist, self.state
        log.info("train.start", rank=dist.arranged_rank, world_size=dist.world_size,
                 device=str(self.device), attn=self.backend,
                 bf16=self.bf16, params=sum(p.numel() for p in self.params), signal=signal.as_dict(),
                 elastic=dist.elastic, resumed_from=state.resumed_from, step=state.step, config=self.run_config)

    # ------------------------------------------------ the loop

    def run(self, batches: Iterable) -> TrainState:
        """Step until the end. Every rank issues the same collectives in the same order: they are
        matched by order, so a phase skipped on one rank would hang the others."""
        cfg = self.cfg
        self.meter = Meter(self.signal.block_size, cfg.total_steps, cfg.epoch_samples, cfg.log_position_every)
        self.start_samples, self.saved_plan, self.last_plan = self.state.samples, self.state.planned_samples, None
        self.broker_plan: int | None = None  # the broker's plan as the ranks agreed it (agree)
        self.broker_progress: float | None = None  # --time-budget: its clock's progress, agreed the same way
        self.last_lr, self.last_progress = None, None
        stager = BatchStager(batches, self.device, self.heads.embed.dtype, prepare=self._plan_ahead) \
            if cfg.stage_batches else None
        self.source: Iterator = stager if stager is not None else iter(batches)
        self.exhausted, self.started = False, time.monotonic()
        self.waited_s, self.reported_at = 0.0, self.started
        self.bad: BatchMismatch | None = None  # a batch no rank could train: the run ends on it
        self.held: Batch | None = None  # our batch of a dropped step (elastic): trained in the next one
        self.stepped_here = False
        try:
            self._loop()
        finally:
            if stager is not None:
                stager.close()
        state = self.finish()
        if self.bad is not None:  # checkpointed and committed first: what was trained stays
            raise self.bad
        return state

    def _loop(self) -> None:
        cfg, state = self.cfg, self.state
        # stop before fetching: a batch fetched and not trained is never acked (`bye` returns it)
        while not self._at_max_steps():
            batch, bad, want_stop = self.fetch()
            self.begin_quorum()
            self._tell_lineage()  # a heal replaced the record: acks name the healer's lineage
            if batch is not None and cfg.skip_held:  # after a heal: the record may hold it now
                kept = drop_held(batch, state)
                if kept is None:  # the weights hold all of it: acked at once, no batch at all
                    self._ack(state.step, batch)
                batch = kept
            agreed = self.agree(batch, bad, want_stop)
            if agreed == _END:
                break
            if agreed == _STEP:
                self.step(batch)

    def _plan_ahead(self, batch: Batch) -> Batch:
        """On the stager's thread, while the previous step trains: the step's host-side plan.
        A batch that does not fit gets none: `fetch` meets its error as always."""
        try:
            check_fit(batch, list(self.signal.target_layers), self.heads.spec.hidden_size, self.heads.spec.vocab_size)
        except BatchMismatch:
            return batch
        return replace(batch, plan=plan_step(batch, self.signal, self.cfg.seed, self.device, self.backend,
                                             count_mask=True))

    def _at_max_steps(self) -> bool:
        if self.cfg.max_steps is not None and self.state.step >= self.cfg.max_steps:
            self.state.end_reason = "max_steps"
            return True
        return False

    def _stop_asked(self) -> bool:
        return self.hooks.stop is not None and self.hooks.stop.is_set()

    def fetch(self) -> tuple[Batch | None, BatchMismatch | None, bool]:
        """(this rank's next batch, its mismatch, whether a stop was asked); a dropped step's batch first."""
        want_stop = self._stop_asked()
        batch, bad, self.held = self.held, None, None
        if batch is None and not self.exhausted and not want_stop:
            t0 = time.monotonic()
            try:
                batch = next(self.source)  # None: nothing arrived in time
            except StopIteration:
                self.exhausted = True
            self.waited_s += time.monotonic() - t0
            # a stop asked while we waited counts now: a shutdown's end is not the stream's natural end
            want_stop = self._stop_asked()
        if batch is not None:
            batch, bad = _prepare(batch, self.heads, self.signal)
        if batch is not None and not self.mask_warned:
            self.mask_warned = _mask_in_data(batch, self.signal, self.state.step + 1, self.dist.rank)
        return batch, bad, want_stop

    def begin_quorum(self) -> None:
        if not self.quorum_begun:  # elastic: the quorum; a replica behind the others is healed here
            self.dist.begin_step()
        self.quorum_begun = False

    def agree(self, batch: Batch | None, bad: BatchMismatch | None, want_stop: bool) -> str:
        """What this step is, the same on every rank: _STEP, _SKIP (wait or retry) or _END. A bad
        batch on any rank ends every rank, so none is left waiting in a collective."""
        dist, state, hooks = self.dist, self.state, self.hooks
        starting = not self.stepped_here and time.monotonic() - self.started < START_WAIT_S
        # an elastic rank signalled alone leaves; the group stops when the broker says or all were signalled
        leaving = want_stop and dist.elastic and hooks.leave is not None and hooks.leave()
        # the broker's plan (and --time-budget clock) as the mean over ranks with a batch, so a re-plan
        # reaching ranks at different steps moves none alone; asked with a batch, once the dataset size is known
        plan = hooks.plan() if hooks.plan is not None and batch is not None else None
        when = hooks.budget_progress() if hooks.budget_progress is not None and batch is not None else None
        have, stops, ended, bads, n_starting, n_leaving, plans, planned, whens, timed = dist.all_sum(
            [batch is not None, want_stop and not leaving, self.exhausted, bad is not None, starting, leaving,
             plan or 0, plan is not None, when or 0.0, when is not None])
        self.broker_plan = round(plans / planned) if planned > 0 else None
        self.broker_progress = whens / timed if timed > 0 else None
        if _step_failed(dist):  # a rank went away: nothing was decided, try again
            self.held = _dropped(batch, state, dist, "quorum")
            return _SKIP
        if bads > 0:  # ends like a stop (checkpoint and commit what was trained), then raises
            self.bad = bad or BatchMismatch("another rank received a batch that does not fit this drafter (see its log)")
            state.end_reason = "bad_batch"
            return _END
        if 0 < n_leaving < dist.world_size and stops == 0:
            return self._leave(batch, leaving)
        if want_stop:
            log.warning("train.stopping", step=state.step, rank=dist.rank)
        if stops > 0 or n_leaving or ended == dist.world_size:
            state.end_reason = "stop" if stops > 0 or n_leaving else "end_of_stream"
            return _END
        if have == 0 or _short_at_start(dist, n_starting):
            if batch is not None:  # waiting for ranks with a batch in hand: no source wait, so sleep
                time.sleep(START_POLL_S)
            self.held = batch
            if hooks.stats is not None:
                hooks.stats["state"] = "waiting"
            return _SKIP
        return _STEP

    def _leave(self, batch: Batch | None, leaving: bool) -> str:
        """Ranks leave between two steps, without a checkpoint (the others hold the same weights);
        the others keep their batch and meet again without them."""
        state, dist = self.state, self.dist
        if not leaving:
            self.held = batch
            return _SKIP
        log.warning("train.leaving", step=state.step, rank=dist.rank, world_size=dist.world_size)
        state.end_reason = "left"
        dist.close()  # stop heartbeating to the lighthouse: the next quorum forms without us
        return _END

    def step(self, batch: Batch | None) -> None:
        """One optimizer step with every rank, in the order things happen; none at all if a
        collective of it fails (elastic)."""
        cfg, dist, state, hooks = self.cfg, self.dist, self.state, self.hooks
        if batch is not None:
            state.epoch = batch.epoch
        if hooks.before_step is not None:  # e.g. live evaluation, on weights that have not seen the batch
            hooks.before_step(state.step, self.model, batch, state.record, state.samples)
        step = state.step + 1
        # the schedule (the lr needs the step's samples, known below) and the noise
        plan = self._plan(step)
        noise = noise_at(step, cfg, state.samples, plan)
        if step == 1 and cfg.feature_scaling:  # a fresh model, before its first batch (drafter/model.py)
            self._calibrate(batch)
        # forward/backward: this rank's gradient sums (step.py), in micro-batches if memory runs out
        self.optimizer.zero_grad(set_to_none=True)
        stats = _no_loss(self.signal.block_size) if batch is None else forward_backward(
            self.model, self.heads, batch, self.signal, seed=cfg.seed, step=step, noise=noise,
            backend=self.backend, loss_chunk=cfg.loss_chunk, bf16=self.bf16, splitter=self.splitter)
        mine = StepFigures.of(batch, stats)
        # all-reduce: every figure in one collective, then the step's samples and the gradients
        total = mine.summed(dist)
        lr = lr_at(step, cfg, state.samples + int(total.samples), plan)  # its own samples included
        self.last_lr, self.last_progress = lr, progress(plan, step, state.samples + int(total.samples))
        pairs = None
        if dist.intact():  # after a failure the sums are not to be trusted (nor sized by)
            pairs = gather_samples(dist, batch, int(total.samples))
            dist.sum_grads(self.params)
        # the commit decision (elastic: a failed collective drops the step on every rank that saw it)
        if not dist.commit():
            self.held = _dropped(batch, state, dist, "step")
            return
        self.stepped_here = True
        record_samples(state, dist, pairs, step)
        # clip and step on averaged gradients (all ranks step or all skip); non-finite stops the run
        batch_id = batch.batch_id if batch is not None else None
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        norm = None
        if total.weight > 0:  # the weight is known on the host (step.py plans it): no read-back
            torch._foreach_div_([p.grad for p in self.params], total.weight)  # one kernel launch, not one a tensor
            norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        # the step's one read-back
        grad_norm = total.read(norm)
        finite.check_step(step, total.loss_sum, None, batch_id, dist.rank)
        if norm is not None:
            finite.check_step(step, total.loss_sum, grad_norm, batch_id, dist.rank)
            self.optimizer.step()
        state.step, state.tokens, state.samples = step, state.tokens + int(total.tokens), \
            state.samples + int(total.samples)
        if batch is not None:  # the ack: the batch is in the weights now
            self._ack(step, batch)
        if hooks.after_step is not None:
            hooks.after_step(step, self.model)
        self._report(step, batch, total, mine, lr=lr, noise=noise, grad_norm=grad_norm)
        if self.ckpt_root is not None and cfg.save_every > 0 and step % cfg.save_every == 0:
            self._commit(self._save())  # the checkpoint on disk, then its commit

    def _calibrate(self, batch: Batch | None) -> None:
        """feature_scale from the first step's batches of every rank."""
        width = self.model.feature_scale.numel()
        sumsq, count = torch.zeros(width, dtype=torch.float64), 0
        if batch is not None:  # in row chunks: no fp32 copy of a whole large batch on the GPU
            h, count = batch.hidden, batch.hidden.shape[0]
            sumsq = sum((h[i:i + 4096].float().pow(2).sum(0).double() for i in range(0, count, 4096)),
                        sumsq.to(h.device)).cpu()
        summed = self.dist.all_sum([*sumsq.tolist(), float(count)])
        calibrate_features(self.model, torch.tensor(summed[:width]), float(summed[width]))
        scale = self.model.feature_scale
        log.info("train.feature_scale", tokens=int(summed[width]), min=round(float(scale.min()), 6),
                 median=round(float(scale.median()), 6), max=round(float(scale.max()), 6), rank=self.dist.rank)

    def _dataset_samples(self) -> int | None:
        stats = self.hooks.progress() if self.hooks.progress is not None else {}
        total = stats.get("samples_total")
        return max(1, int(total) - int(stats.get("samples_skipped") or 0)) if total else None

    def _plan(self, step: int) -> Plan:
        """The schedule's plan for `step` (train_config.choose_plan); a new one is logged."""
        state, hooks = self.state, self.hooks
        stream = None if hooks.stream_samples is None else self.start_samples + hooks.stream_samples
        plan = choose_plan(self.cfg, broker=self.broker_plan, checkpoint=self.saved_plan, stream=stream,
                           time=self.broker_progress, dataset=self._dataset_samples())
        last = self.last_plan
        if last is not None and plan.by == last.by == "time":  # moves with the broker's clock: logged once
            self.last_plan, state.planned_samples = plan, None
            return plan
        if last is not None and (plan.by, plan.length, plan.source) == (last.by, last.length, last.source):
            plan = last  # unchanged: it keeps where it started from
        elif last is not None and plan.by == last.by == "samples" and plan.source == last.source == "broker":
            plan = last.moved_to(plan, state.samples)  # the broker re-planned (--time-budget)
        if plan != self.last_plan:
            fields = dict(step=step, samples=state.samples, **plan.as_dict(), lr=self.cfg.lr, min_lr=self.cfg.min_lr,
                          warmup=self.cfg.warmup, rank=self.dist.rank)
            if plan.by == "constant":
                log.warning("train.schedule", **fields, hint="give --total-samples (or --total-steps) for warmup "
                            "and cosine decay; with a broker the plan is its epochs x samples")
            else:
                log.info("train.schedule", **fields)
            self.last_plan = plan
        state.planned_samples = plan.length if plan.by == "samples" else None
        return plan

    def _ack(self, step: int, batch: Batch) -> None:
        if self.hooks.on_step is not None:
            self.hooks.on_step(step, [batch.batch_id])

    def _report(self, step: int, batch: Batch | None, total: StepFigures, mine: StepFigures, *, lr: float,
                noise: float, grad_norm: float) -> None:
        state, hooks, dist, splitter = self.state, self.hooks, self.dist, self.splitter
        now = time.monotonic()
        waited, wall = self.waited_s, now - self.reported_at
        self.waited_s, self.reported_at = 0.0, now
        line = self.meter.log_step(step, total, mine, lr=lr, noise=noise, grad_norm=grad_norm, samples=state.samples,
                                   wait_s=waited, wall_s=wall,
                                   tokens_seen=state.tokens, epoch=state.epoch,
                                   queue=hooks.queue() if hooks.queue else {},
                                   progress=hooks.progress() if hooks.progress else None, rank=dist.rank,
                                   micro_batches=splitter.last_splits if batch is not None else 0, ooms=splitter.ooms)
        if hooks.on_metrics is not None and dist.rank == 0:
            hooks.on_metrics(step, line)
        if hooks.stats is not None:
            hooks.stats.update({k: line[k] for k in ("step", "loss", "acc", "streak", "tokens_per_s", "batches_per_s")},
                               state="training", rank=dist.rank, world_size=dist.world_size, **splitter.heartbeat())

    def _save(self) -> Path | None:
        """A checkpoint of this step (every rank takes part); its folder on rank 0."""
        return train_checkpoint.save(self, self.ckpt_root)

    def _commit(self, path: Path | None) -> None:
        """Rank 0 commits the checkpoint; every rank waits, so none runs ahead of one that may fail."""
        if path is not None and self.hooks.on_checkpoint is not None:
            self.hooks.on_checkpoint(self.state.step, path)
        self.dist.barrier()

    def finish(self) -> TrainState:
        state = self.state
        if self.ckpt_root is not None and state.step > state.saved_step and state.end_reason != "left":
            self._commit(self._save())
        p, lr = self.last_progress, self.last_lr
        log.info("train.end", reason=state.end_reason, step=state.step, tokens=state.tokens, rank=self.dist.rank,
                 samples=state.samples, lr=lr, progress=None if p is None else round(p, 6))
        if p is not None and p < 1.0 and state.end_reason in ("stop", "bad_batch"):
            # stopped before its plan was trained: the weights keep a lr that never annealed
            log.warning("train.unannealed", reason=state.end_reason, step=state.step, samples=state.samples,
                        planned_samples=state.planned_samples, progress=round(p, 6), lr=lr, min_lr=self.cfg.min_lr,
                        rank=self.dist.rank, hint="these weights were saved before the lr schedule reached "
                        "--min-lr: resume the run (dflash-broker --resume RUN) to train the rest of its plan")
        state.model = self.model
        return state


# ---------------------------------------------------------------- helpers of a step


def auto_compiles(device: torch.device) -> bool:
    """Whether auto takes compiled kernels: on a GPU with a host C compiler (Triton builds a
    launcher with it; without one the first step would fail), else eager, warned."""
    if device.type != "cuda":
        return False
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        log.warning("train.compile_unavailable", device=str(device), attn="sdpa", fuse="off",
                    hint="install a C compiler (e.g. gcc) for flex attention and fused kernels: much faster "
                         "steps on a GPU (docs/BENCHMARKS.md)")
    return compiler is not None


def _no_loss(block_size: int) -> LossStats:
    return LossStats(pos_correct=[0] * (block_size - 1), pos_valid=[0] * (block_size - 1))


def _step_failed(dist: DistGroup) -> bool:
    """A collective of this step failed (elastic); torchft is told, so the next quorum rebuilds."""
    if dist.intact():
        return False
    dist.commit()
    return True


def _dropped(batch: Batch | None, state: TrainState, dist: DistGroup, at: str) -> Batch | None:
    """Log a dropped step; our batch, trained again in the next step (not acked)."""
    log.warning("train.step_dropped", step=state.step + 1, at=at, rank=dist.rank, world_size=dist.world_size,
                batch_id=batch.batch_id if batch is not None else None,
                samples=len(batch.samples) if batch is not None else 0, error=dist.error())
    return batch


def _short_at_start(dist: DistGroup, n_starting: float) -> bool:
    """Elastic start: every rank of the quorum is new and not all N have joined yet."""
    return dist.elastic and n_starting == dist.world_size and dist.world_size < dist.max_world


def _prepare(batch: Batch, heads: TargetHeads, signal) -> tuple[Batch | None, BatchMismatch | None]:
    """The batch checked against the signal, or the mismatch: training on other target layers would
    silently learn the wrong thing, so the caller stops every rank."""
    if not isinstance(batch, Batch):
        raise TypeError(f"expected a Batch or None from the batch source, got {type(batch).__name__}")
    if batch.frames:  # as the link read it, not staged (staging.py does this on its thread)
        batch = batch.owned(heads.embed.dtype)  # a copy: frames are read-only
    try:
        check_fit(batch, list(signal.target_layers), heads.spec.hidden_size, heads.spec.vocab_size)
        if signal.distill > 0 and batch.final_hidden is None:
            raise BatchMismatch(f"batch {batch.batch_id} has no final_hidden, which --distill-weight needs: start "
                                "the producers with --final-hidden")
    except BatchMismatch as e:
        log.error("train.batch_mismatch", batch_id=batch.batch_id, error=str(e), layer_ids=batch.layer_ids,
                  target_layers=list(signal.target_layers), width=int(batch.hidden.shape[1]))
        return None, e
    return batch, None


def _mask_in_data(batch: Batch, signal, step: int, rank: int) -> bool:
    """Warn once when a batch holds the MASK token: the drafter cannot tell it from a position to draft."""
    plan = batch.plan
    hits = plan.mask_hits if isinstance(plan, StepPlan) and plan.mask_hits is not None else \
        mask_in_batch(batch.input_ids, signal.mask_token_id)
    if hits:
        log.warning("train.mask_in_data", step=step, rank=rank, batch_id=batch.batch_id,
                    mask_token_id=signal.mask_token_id, tokens=hits, rule=(signal.mask_choice or {}).get("rule"),
                    hint="choose another --mask-token-id: a row the data never contains")
    return bool(hits)
