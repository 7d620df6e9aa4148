"""The drafter training loop, top to bottom: config, setup, resume, one loop.

The loop knows nothing about the network. It takes
  - `batches`: an iterator of `Batch` (or decoded batch messages); it may block while
    waiting for data, yields None for "nothing arrived in time" (this rank takes an empty
    step if another rank has a batch), and ends (StopIteration) at the end of the stream;
  - `Hooks`: `on_step(step, batch_ids)` after the optimizer step that used those batches
    (the broker `ack`), `on_checkpoint(step, path)` on rank 0 once a checkpoint is durable
    (the broker `commit`), `queue()` for the queue figures to log, `progress()` for the
    run's sample counts (epoch fraction, ETA), `stop` to end early.
Every rank runs this same loop; ranks agree each step on whether anyone still has data.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from dflash.protocol.logs import get_logger

from .batch import Batch, BatchMismatch
from . import fused
from .checkpoint import Signal
from .dist import Dist
from .exactly_once import drop_held, gather_samples, record_samples
from .loss import LossStats, default_gamma
from .metrics import Meter, local_figures, named
from .model import DFlashDraft, DrafterConfig, published_config
from .oom import OomInjection, StepSplitter
from .record import TrainedRecord
from .replica import replica_state, take_replica_state
from .step import batch_loss
from .target_heads import TargetHeads, tokenizer_mask_id
from . import train_checkpoint

log = get_logger()

# Elastic start: while every rank of the quorum is new (none has stepped) and fewer than
# the broker's --consumers N have joined, ranks wait this long for the rest before the
# first step, as a fixed group does; afterwards a joiner never holds the others up.
START_WAIT_S = 60.0


@dataclass(frozen=True)
class TrainConfig:
    # training signal (recorded in every checkpoint; see checkpoint.Signal)
    draft_layers: int = 5
    target_layers: tuple[int, ...] | None = None  # None: 5 layers spaced from 1 to L-3
    block_size: int = 16
    anchors: int = 512
    gamma: float | None = None  # None: default_gamma(block_size)
    mask_token_id: int | None = None  # None: Qwen3's 151669 for Qwen3 vocabularies
    # optimisation
    lr: float = 6e-4
    min_lr: float = 0.0
    warmup: float = 0.04  # fraction of total_steps
    total_steps: int | None = None  # schedule length; None: constant lr after no warmup
    max_steps: int | None = None  # stop after this many steps (None: end of stream)
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    feature_noise: float = 0.0  # relative Gaussian noise on target features at step 0
    noise_schedule: str = "linear"  # constant | linear | cosine decay to 0 at total_steps
    seed: int = 0
    # implementation
    loss_chunk: int = 2048  # block positions per logits chunk
    attn: str = "auto"  # auto (= sdpa) | sdpa | flex (block-sparse, compiled on GPU)
    precision: str = "auto"  # auto (bf16 autocast on GPU, fp32 on CPU) | bf16 | fp32
    fuse: str = "auto"  # torch.compile the elementwise work (consumers/fused.py): auto (= on GPU) | on | off
    # checkpoints and logs
    save_every: int = 1000
    keep: int = 3
    resume: str | None = None  # checkpoint folder, run ID/folder, or "latest"
    force: bool = False  # resume even if the training signal differs
    log_position_every: int = 100
    epoch_samples: int | None = None  # samples per epoch, for the epoch fraction and ETA
    # Leave out sequences whose (epoch, sample) the weights already hold (the record):
    # on with a broker, where a crash can make a sample again (exactly-once); off for local
    # streams, which may repeat a batch on purpose
    skip_held: bool = False


@dataclass
class Hooks:
    on_step: Callable[[int, list[str]], None] | None = None
    on_checkpoint: Callable[[int, Path], None] | None = None
    queue: Callable[[], dict] | None = None
    # The run's sample counts, {samples_total, samples_done, n_samples} (the broker's
    # heartbeat): the logged epoch fraction and ETA come from them when present.
    progress: Callable[[], dict] | None = None
    stop: threading.Event | None = None
    after_step: Callable[[int, torch.nn.Module], None] | None = None  # every rank, e.g. evaluation
    # Every rank, before a step's forward: (optimizer steps so far, model, this rank's batch
    # or None, the record); live evaluation on a batch the weights have not trained on yet.
    before_step: Callable[[int, torch.nn.Module, Batch | None, TrainedRecord], None] | None = None
    # Updated in place after every step with the consumer's heartbeat keys (PROTOCOL.md
    # 4.2: step, loss, acc, streak, tokens_per_s, batches_per_s, state), for an I/O thread
    # to read.
    stats: dict | None = None


@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0  # target tokens trained on, all ranks
    samples: int = 0
    epoch: int = 0
    resumed_from: str | None = None
    saved_step: int = 0  # the newest checkpoint's step (every rank agrees: it decides a collective)
    end_reason: str = ""
    last_checkpoint: Path | None = None
    model: torch.nn.Module | None = field(default=None, repr=False)  # the trained drafter
    # (epoch, sample) -> times trained, all ranks, cumulative over resumes (record.py)
    record: TrainedRecord = field(default_factory=TrainedRecord, repr=False)


# ---------------------------------------------------------------- setup


def default_target_layers(num_target_layers: int, n: int = 5) -> tuple[int, ...]:
    """n layers evenly spaced from 1 to L-3 (DFLASH.md; Qwen3-8B: 1, 9, 17, 25, 33).

    The producers' rule exactly (producers/target.py default_layer_ids), so both sides'
    `auto` agree: small targets get the distinct layers rounding yields (6 layers ->
    1, 2, 3), and below 4 layers the range is 0..L-2."""
    start, end = (1, num_target_layers - 3) if num_target_layers >= 4 else (0, max(0, num_target_layers - 2))
    if n == 1:
        return ((start + end) // 2,)
    return tuple(sorted({int(round(start + i * (end - start) / (n - 1))) for i in range(n)}))


def resolve_signal(cfg: TrainConfig, heads: TargetHeads) -> Signal:
    """Fill the defaults that depend on the target. Raises ValueError on bad values."""
    spec = heads.spec
    layers = tuple(cfg.target_layers or default_target_layers(spec.num_hidden_layers))
    if any(not 0 <= i < spec.num_hidden_layers - 1 for i in layers):
        # The last layer is excluded on purpose (SGLang #32204): it is the LM head's input.
        raise ValueError(f"target layers {list(layers)} must lie in 0..{spec.num_hidden_layers - 2}")
    mask = cfg.mask_token_id
    if mask is None:
        mask = tokenizer_mask_id(heads.path)
    if mask is None:
        if spec.model_type.startswith("qwen3") and spec.vocab_size > 151669:
            mask = 151669
        else:
            raise ValueError(f"--mask-token-id is required for a {spec.model_type} target (an unused vocab row)")
    if not 0 <= mask < spec.vocab_size:
        raise ValueError(f"mask token id {mask} outside the vocabulary (0..{spec.vocab_size - 1})")
    if cfg.block_size < 2 or cfg.anchors < 1 or cfg.draft_layers < 1:
        raise ValueError("block size must be >= 2, anchors and draft layers >= 1")
    gamma = float(cfg.gamma) if cfg.gamma is not None else default_gamma(cfg.block_size)
    return Signal(cfg.anchors, cfg.block_size, layers, gamma, cfg.draft_layers, mask, heads.identity)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup*total steps, then cosine down to min_lr (step is 1-based)."""
    if not cfg.total_steps:
        return cfg.lr
    warm = max(1, math.ceil(cfg.warmup * cfg.total_steps))
    if step <= warm:
        return cfg.lr * step / warm
    p = min(1.0, (step - warm) / max(1, cfg.total_steps - warm))
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * p)) * (cfg.lr - cfg.min_lr)


def noise_at(step: int, cfg: TrainConfig) -> float:
    if cfg.feature_noise <= 0:
        return 0.0
    if cfg.noise_schedule == "constant" or not cfg.total_steps:
        return cfg.feature_noise
    p = min(1.0, step / cfg.total_steps)
    f = 1.0 - p if cfg.noise_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return cfg.feature_noise * f


# ---------------------------------------------------------------- the loop


def train(
    cfg: TrainConfig,
    heads: TargetHeads,
    batches: Iterable,
    *,
    dist: Dist | None = None,
    ckpt_root: Path | None = None,
    runs_dir: str | Path | None = None,
    run_config: dict | None = None,
    hooks: Hooks | None = None,
) -> TrainState:
    """Train until the stream ends, `max_steps`, or `hooks.stop`. Returns the final state.

    Raises SignalMismatch (resume with another signal), BatchMismatch (a batch for
    another drafter), ValueError (bad config)."""
    dist = dist or Dist()
    hooks = hooks or Hooks()
    device = heads.embed.device
    signal = resolve_signal(cfg, heads)
    # auto = SDPA everywhere for now. On an H200 flex is 1.7x faster (MFU 26% -> 43%, 57%
    # with --fuse; docs/BENCHMARKS.md) but was only run on fixed batch shapes there, and its
    # first step compiles for ~1 min: opt-in until a real stream has run with it.
    backend = "sdpa" if cfg.attn == "auto" else cfg.attn
    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")

    fused.enable(cfg.fuse == "on" or (cfg.fuse == "auto" and device.type == "cuda"))

    # Model: fp32 master weights, same init on every rank, then rank 0's copy everywhere.
    torch.manual_seed(cfg.seed)
    mcfg = DrafterConfig.from_target(heads.spec, cfg.draft_layers, len(signal.target_layers))
    model = DFlashDraft(mcfg).to(device)
    dist.broadcast_params(model)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  fused=device.type == "cuda")
    splitter = StepSplitter(params, device, inject=OomInjection.from_env())
    state = TrainState()
    torch.manual_seed(cfg.seed + 1 + dist.rank)  # anything random besides the seeded noise and anchors
    # An elastic group (elastic.py) hands this state to a joining replica, and heals us
    # with a healthier one's; the quorum compares steps to decide who heals. The first
    # quorum comes before the resume: a consumer joining a live run is healed from a
    # running one (the checkpoint it was told may be pruned by now, and is older anyway).
    dist.register_state(lambda: replica_state(model, optimizer, state, signal),
                        lambda got: take_replica_state(got, model, optimizer, state, signal, dist))
    met = dist.elastic
    if met:
        dist.begin_step()
    if cfg.resume and state.step == 0:  # not healed to a live step
        train_checkpoint.resume(cfg, signal, model, optimizer, state, dist, runs_dir)
        dist.set_step(state.step)
    drafter_json = published_config(mcfg, heads.spec, block_size=signal.block_size,
                                    mask_token_id=signal.mask_token_id, target_layer_ids=list(signal.target_layers))
    # rank: the one the broker arranged (elastic: a step's quorum rank may differ, train.step says)
    log.info("train.start", rank=getattr(dist, "arranged_rank", dist.rank), world_size=dist.world_size,
             device=str(device), attn=backend,
             bf16=bf16, params=sum(p.numel() for p in params), signal=signal.as_dict(), elastic=dist.elastic,
             resumed_from=state.resumed_from, step=state.step, config=run_config)

    meter = Meter(signal.block_size, cfg.total_steps, cfg.epoch_samples, cfg.log_position_every)
    source: Iterator = iter(batches)
    exhausted, started = False, time.monotonic()
    held: Batch | None = None  # our batch of a dropped step (elastic): trained in the next one
    stepped_here = False  # this process took a step (the startup wait ends)
    while True:
        # Stop before fetching: a fetched batch that is never trained is never acked.
        if cfg.max_steps is not None and state.step >= cfg.max_steps:
            state.end_reason = "max_steps"
            break
        want_stop = hooks.stop is not None and hooks.stop.is_set()
        batch, bad, held = held, None, None
        if batch is None and not exhausted and not want_stop:
            try:
                batch = next(source)  # None: nothing arrived in time (the source waited)
            except StopIteration:
                exhausted = True
            # A stop asked while we waited (a signal, the broker's shutdown) counts now, so
            # the stream a shutdown ends is not taken for its natural end.
            want_stop = hooks.stop is not None and hooks.stop.is_set()
        if batch is not None:
            batch, bad = _prepare(batch, heads, signal)
        if not met:  # elastic: the quorum; a replica behind the others is healed here
            dist.begin_step()
        met = False
        if batch is not None and cfg.skip_held:  # after a heal: the record may hold it now
            batch = drop_held(batch, state, hooks)
        # Every rank takes part in every step (one small collective first): stop when one
        # rank was asked to or every rank's stream ended; a rank without a batch takes an
        # empty step while another has one; nobody steps while nobody has data. A bad
        # batch on any rank ends every rank, so none is left waiting in a collective.
        starting = not stepped_here and time.monotonic() - started < START_WAIT_S
        have, stops, ended, bads, n_starting = dist.all_sum(
            [batch is not None, want_stop, exhausted, bad is not None, starting])
        if _step_failed(dist):  # a rank went away: nothing was decided, try again
            held = _dropped(batch, state, dist, "quorum")
            continue
        if bads > 0:
            raise bad or BatchMismatch("another rank received a batch that does not fit this drafter (see its log)")
        if want_stop:
            log.warning("train.stopping", step=state.step, rank=dist.rank)
        if stops > 0 or ended == dist.world_size:
            state.end_reason = "stop" if stops > 0 else "end_of_stream"
            break
        if have == 0 or _short_at_start(dist, n_starting):
            held = batch
            if hooks.stats is not None:
                hooks.stats["state"] = "waiting"
            continue
        if batch is not None:
            state.epoch = batch.epoch
        if hooks.before_step is not None:
            hooks.before_step(state.step, model, batch, state.record)

        step = state.step + 1
        lr, noise = lr_at(step, cfg), noise_at(step, cfg)
        for g in optimizer.param_groups:
            g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        stats = LossStats(pos_correct=[0] * (signal.block_size - 1), pos_valid=[0] * (signal.block_size - 1))
        if batch is not None:  # split into micro-batches if memory runs out (oom.py)
            stats = splitter.run(batch, _forward_backward(model, heads, signal, cfg, backend, bf16, step, noise), step)
        mine = local_figures(batch, stats)
        total = dist.all_sum(mine)  # one small collective for every figure a step logs
        pairs = None
        if dist.intact():  # after a failure the sums are not to be trusted (nor sized by)
            pairs = gather_samples(dist, batch, int(named(total)["samples"]))
            dist.sum_grads(params)
        if not dist.commit():  # elastic: a collective failed; dropped on every rank that saw it
            held = _dropped(batch, state, dist, "step")
            continue
        stepped_here = True
        record_samples(state, dist, pairs, step)
        weight = named(total)["weight"]
        grad_norm = 0.0
        if weight > 0:  # all ranks see the same weight: they all step or all skip
            for p in params:
                p.grad.div_(weight)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
            optimizer.step()

        state.step = step
        state.tokens += int(named(total)["tokens"])
        state.samples += int(named(total)["samples"])
        if batch is not None and hooks.on_step is not None:
            hooks.on_step(step, [batch.batch_id])
        if hooks.after_step is not None:
            hooks.after_step(step, model)
        line = meter.log_step(step, total, mine, lr=lr, noise=noise, grad_norm=grad_norm, samples=state.samples,
                              tokens_seen=state.tokens, epoch=state.epoch, queue=hooks.queue() if hooks.queue else {},
                              progress=hooks.progress() if hooks.progress else None, rank=dist.rank,
                              micro_batches=splitter.last_splits if batch is not None else 0, ooms=splitter.ooms)
        if hooks.stats is not None:
            hooks.stats.update({k: line[k] for k in ("step", "loss", "acc", "streak", "tokens_per_s", "batches_per_s")},
                               state="training", rank=dist.rank, world_size=dist.world_size, **splitter.heartbeat())
        if ckpt_root is not None and cfg.save_every > 0 and step % cfg.save_every == 0:
            train_checkpoint.save(cfg, signal, model, optimizer, state, dist, ckpt_root, drafter_json, hooks, run_config)

    if ckpt_root is not None and state.step > state.saved_step:
        train_checkpoint.save(cfg, signal, model, optimizer, state, dist, ckpt_root, drafter_json, hooks, run_config)
    log.info("train.end", reason=state.end_reason, step=state.step, tokens=state.tokens, rank=dist.rank)
    state.model = model
    return state


def _step_failed(dist: Dist) -> bool:
    """True when a collective of this step failed (elastic: a peer went away). torchft is
    told (should_commit answers False), so the next quorum rebuilds the group."""
    if dist.intact():
        return False
    dist.commit()
    return True


def _dropped(batch: Batch | None, state: TrainState, dist: Dist, at: str) -> Batch | None:
    """Log a dropped step; return our batch, trained again in the next step (not acked:
    nothing of it reached the weights or the record here)."""
    log.warning("train.step_dropped", step=state.step + 1, at=at, rank=dist.rank, world_size=dist.world_size,
                batch_id=batch.batch_id if batch is not None else None,
                samples=len(batch.samples) if batch is not None else 0, error=dist.error())
    return batch


def _short_at_start(dist: Dist, n_starting: float) -> bool:
    """Elastic start: every rank of the quorum is new and not all N have joined yet."""
    max_world = getattr(dist, "max_world", dist.world_size)
    return dist.elastic and n_starting == dist.world_size and dist.world_size < max_world


def _prepare(batch, heads: TargetHeads, signal) -> tuple[Batch | None, BatchMismatch | None]:
    """The batch as a `Batch` checked against this drafter's signal, or the mismatch.

    A batch of other target layers (or width) is a misconfigured run, not a bad message:
    training on it would silently learn the wrong thing, so the caller stops every rank."""
    if not isinstance(batch, Batch):
        batch = Batch.from_message(batch, heads.embed.dtype)  # a copy: frames are read-only
    try:
        batch.check(list(signal.target_layers), heads.spec.hidden_size)
    except BatchMismatch as e:
        log.error("train.batch_mismatch", batch_id=batch.batch_id, error=str(e), layer_ids=batch.layer_ids,
                  target_layers=list(signal.target_layers), width=int(batch.hidden.shape[1]))
        return None, e
    return batch, None


def _forward_backward(model, heads, signal, cfg, backend, bf16, step, noise) -> Callable[[Batch], LossStats]:
    """Forward and backward of one (micro-)batch of `step`: d(sum of weighted CE) is added
    to every `.grad`; the loop divides by the global weight once every part is in."""
    device = heads.embed.device

    def run(part: Batch) -> LossStats:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss_sum, stats = batch_loss(model, heads, part, signal, seed=cfg.seed, backend=backend, noise=noise,
                                         loss_chunk=cfg.loss_chunk, step=step)
        if loss_sum is not None:
            loss_sum.backward()
        return stats

    return run
