"""One consumer process, given its `ConsumerConfig`: setup (logging, device, target
heads), then either the broker's run (`_serve`: its ranks and batches, through
protocol/links.py ConsumerLink) or a local synthetic stream (`_local`, `--synthetic-batches`:
a run of its own), each handing the batches to the Trainer (training/train.py)."""

from __future__ import annotations

import json
import os
import threading
import traceback
from dataclasses import replace
from pathlib import Path

import click
import torch

from dflash.consumers.process.config import ConsumerConfig
from dflash.consumers.checkpoints.checkpoint import nothing_to_resume, resolve_checkpoint
from dflash.consumers.evaluation.live_eval import LiveEval
from dflash.consumers.evaluation.real_tau import RealTauSet
from dflash.consumers.parallel.dist import Dist, RankLost, collective_failures_named
from dflash.consumers.training.train import train
from dflash.consumers.training.train_config import Hooks, TrainState, resolve_signal
from dflash.consumers.training.config import TrainConfig
from dflash.protocol.curve import client_from
from dflash.protocol.errors import BrokerUnreachable, DFlashError, Rejected
from dflash.protocol.links import ConsumerLink
from dflash.protocol.messages import RunConfig
from dflash.protocol.peer import BrokerLost, exit_broker_lost, exit_when_stuck
from dflash.protocol.training_signal import SignalMismatch, signal_differences
from dflash.runtime.alloc import reuse_freed_memory
from dflash.runtime.command_line import as_dict, fail
from dflash.runtime.fdlimit import raise_open_files
from dflash.runtime.logs import bind_run, close_logging, get_logger, setup_logging
from dflash.runtime.run import hostname, make_run_dir, new_run_id, point_latest, write_run_json
from dflash.runtime.run import run_dir as run_folder
from dflash.runtime.stop import GracefulStop
from dflash.runtime.target_heads import TargetLoadError, load_target_heads

from .broker_hooks import BrokerHooks, broker_batches, failure, nothing_left_to_train
from .join import (
    arranged_dist,
    await_run_facts,
    check_run_target,
    hello_config,
    offer_dist_addr,
    resume_point,
    run_config_of,
    run_layers,
)
from .quiet import quiet_library_noise
from .synthetic import synthetic_stream

log = get_logger()


def run(cfg: ConsumerConfig) -> None:
    """Set up and train; exits non-zero with a one-line reason on bad input (2) or when
    the broker is unreachable, refuses us or is lost (1)."""
    reuse_freed_memory()  # before ZeroMQ starts its I/O threads: each received batch reuses freed memory
    setup_logging("consumer", cfg.instance, gpu=cfg.gpu, level=cfg.log_level)
    raise_open_files("consumer")
    quiet_library_noise()
    device = torch.device("cpu") if cfg.gpu is None else torch.device("cuda", cfg.gpu)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist, stop = None, None
    try:
        if cfg.eval_prompts and not cfg.eval_every:
            raise ValueError("--eval-prompts is used by the live evaluation: give --eval-every N too")
        log.info("consume.start", config=_json_config(cfg), device=str(device),
                 source="synthetic" if cfg.synthetic_batches else cfg.broker)
        heads = load_target_heads(cfg.target, device=device,
                                  dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        tcfg = cfg.train
        if cfg.synthetic_batches and (why := nothing_to_resume(tcfg.resume, cfg.runs_dir)):
            log.info("consume.resume_point", checkpoint=None, parent_run=None, why=why)
            tcfg = replace(tcfg, resume=None)
        if tcfg.resume and cfg.synthetic_batches:  # before this run's folder exists; records the parent
            tcfg = replace(tcfg, resume=str(resolve_checkpoint(tcfg.resume, cfg.runs_dir)))
        elif tcfg.resume and tcfg.resume != "latest":
            resolve_checkpoint(tcfg.resume, cfg.runs_dir)  # a wrong path fails before connecting
        resolve_signal(tcfg, heads)  # bad settings fail here, before anything connects
        # first signal: finish the step, checkpoint, exit 0; second: die. Before training (not armed,
        # e.g. a rendezvous waiting minutes) a signal ends us at once: nothing to save yet
        stop = GracefulStop(armed=False).install()
        if cfg.synthetic_batches:
            dist = _own_dist(cfg, device) or Dist(device=device)
            state = _local(cfg, tcfg, heads, dist, stop)
        else:
            state, dist = _serve(cfg, tcfg, heads, device, stop)
        log.info("consume.done", step=state.step, reason=state.end_reason, tokens=state.tokens,
                 samples=state.samples, last_checkpoint=str(state.last_checkpoint) if state.last_checkpoint else None)
        # stderr: stdout carries only the JSON log lines (a pipe into jq must parse every line)
        if state.end_reason == "left":
            click.echo(f"left the elastic group at step {state.step}; the other consumers go on and commit these "
                       "weights (theirs too); stop the broker to stop the whole job", err=True)
        else:
            click.echo(f"done: {state.step} steps ({state.end_reason}), {_checkpoint_words(state, dist)}", err=True)
    except (DFlashError, TargetLoadError, ValueError, FileNotFoundError) as e:
        # PROTOCOL.md 4.2: a silent broker is logged as `*.broker_lost`
        log.error("consume.broker_lost" if isinstance(e, BrokerLost) else "consume.failed", error=str(e),
                  error_type=type(e).__name__)
        if isinstance(e, BrokerLost):  # no teardown to wait for (torchft's threads die with us)
            exit_broker_lost(e)
        fail(str(e), code=1 if isinstance(e, (BrokerUnreachable, Rejected, BrokerLost, RankLost)) else 2)
    except Exception as e:  # a bug or a library failure: still the run's log says why we died
        log.error("consume.failed", error=str(e)[:2000], error_type=type(e).__name__,
                  traceback=traceback.format_exc())
        raise
    finally:
        if stop is not None:
            stop.restore()
        if dist is not None:
            dist.close()
        close_logging()


def _checkpoint_words(state, dist: Dist | None) -> str:
    """The done line's checkpoint words: only rank 0 writes them (others' None read as a failure)."""
    if state.last_checkpoint is not None:
        return f"last checkpoint {state.last_checkpoint}"
    if dist is not None and dist.rank != 0:
        return f"rank {dist.rank}: checkpoints are written by rank 0"
    return "no checkpoint written"


def _own_group(cfg: ConsumerConfig) -> tuple[int, int]:
    """(rank, world_size) of ranks arranged outside the broker (--dist-init or torchrun's env)."""
    if cfg.dist_init:
        return cfg.rank, cfg.world_size
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _own_dist(cfg: ConsumerConfig, device: torch.device) -> Dist | None:
    """A data-parallel group arranged outside the broker (--dist-init or torchrun), or None."""
    if cfg.dist_init:
        return Dist.init(init_method=cfg.dist_init, rank=cfg.rank, world_size=cfg.world_size, device=device)
    return Dist.from_torchrun(device)


def _local(cfg: ConsumerConfig, tcfg: TrainConfig, heads, dist: Dist, stop: threading.Event):
    """A run of our own on the synthetic stream: no broker, our own run folder."""
    run_dir = _start_run(cfg, tcfg, dist)
    signal_ = resolve_signal(tcfg, heads)
    stop.armed = True
    source = synthetic_stream(heads.spec, list(signal_.target_layers), batches=cfg.synthetic_batches,
                              n_seqs=cfg.synthetic_seqs, seq_len=cfg.synthetic_seq_len, rank=dist.rank,
                              seed=tcfg.seed, dtype=heads.embed.dtype)
    live = _live_eval(cfg, heads, signal_, dist.rank, None)
    stream = cfg.synthetic_batches * cfg.synthetic_seqs * dist.world_size  # every rank's synthetic samples
    sink = _sink(cfg, run_dir.name, run_dir, dist.rank)
    try:
        state = train(tcfg, heads, source, dist=dist, ckpt_root=run_dir / "checkpoints", runs_dir=cfg.runs_dir,
                      run_config=_json_config(cfg), hooks=Hooks(stop=stop, before_step=live and live.before_step,
                                                                stream_samples=stream, on_metrics=sink))
    finally:
        if sink is not None:
            sink.close()
    if live and state.end_reason != "stop":
        live.final(state.step, state.model, state.samples)
    return state


def _serve(cfg: ConsumerConfig, tcfg: TrainConfig, heads, device: torch.device, stop: threading.Event):
    """Join the broker's run as one data-parallel rank and train until it says stop; (state, dist)."""
    own = bool(cfg.dist_init) or "RANK" in os.environ  # ranks arranged outside the broker
    dist_addr = None if own else (cfg.dist_addr or offer_dist_addr(cfg.broker))
    link = ConsumerLink(cfg.broker, cfg.instance, gpu=cfg.gpu, run=cfg.run_id, runs_dir=cfg.runs_dir,
                        curve=client_from(cfg.curve_keys, cfg.curve_name), inbox_bytes=cfg.inbox_bytes,
                        config=hello_config(resolve_signal(tcfg, heads), dist_addr,
                                            auto_layers=tcfg.target_layers is None,
                                            group=_own_group(cfg) if own else None),
                        stats=lambda: plugs.heartbeat() if plugs else dict(early),
                        on_lost=exit_when_stuck("consumer"))
    plugs, dist, reason, early, sink = None, None, "failed", {"state": "starting"}, None
    link.start()  # binds our log to the broker's run: runs/<run_id>/logs/consumer-<instance>.jsonl
    try:
        run_config = run_config_of(link)
        # Refused at start (another run's checkpoint), before any wait for the run's layers
        resume = resume_point(tcfg.resume, run_config, cfg.runs_dir, run_id=link.run_id)
        if tcfg.target_layers is None:  # auto: never build the drafter on layers guessed here
            early["state"] = "waiting"  # for a producer, as a starved consumer does
            run_config = await_run_facts(link, run_config)
        if run_config is None:  # stopped before any producer came: nothing was trained, nothing to save
            reason = "done" if link.stop_reason == "end_of_stream" else "stop"
            return TrainState(end_reason="end_of_stream" if reason == "done" else "stop"), Dist(device=device)
        check_run_target(run_config, heads.identity)
        tcfg = run_layers(tcfg, run_config, heads.spec.hidden_size)
        tcfg = replace(tcfg, resume=resume, skip_held=True)
        with collective_failures_named():
            dist = (_own_dist(cfg, device) if own else arranged_dist(run_config, device, cfg.instance, cfg.broker)
                    ) or Dist(device=device)
            _check_world(dist, run_config)
            signal_ = resolve_signal(tcfg, heads)
            if not dist.elastic:  # elastic: a joiner checks the signal of the state it is healed with
                _same_signal(dist, signal_)
            plugs = BrokerHooks(link, dist.rank, stop, device, resumed_from=tcfg.resume)
            # A signal to this process (not the broker's stop): in an elastic group it leaves alone
            plugs.hooks.leave = lambda: getattr(stop, "signal_name", None) is not None
            live = _live_eval(cfg, heads, signal_, dist.rank, plugs.stats)
            plugs.hooks.before_step = live and live.before_step
            plugs.hooks.on_metrics = sink = _sink(cfg, link.run_id, run_folder(link.run_id, cfg.runs_dir), dist.rank)
            stop.armed = True  # from here a signal means: finish the step, checkpoint, commit
            try:
                state = train(tcfg, heads, broker_batches(link, stop), dist=dist,
                              ckpt_root=run_folder(link.run_id, cfg.runs_dir) / "checkpoints", runs_dir=cfg.runs_dir,
                              run_config={**_json_config(cfg), "broker_run_config": run_config.fields()},
                              hooks=plugs.hooks)
            except FileNotFoundError as e:
                state = nothing_left_to_train(link, e)
        if sink is not None:
            sink.close()
        if dist.rank == 0 and state.end_reason == "end_of_stream":
            plugs.commit_final(state.step)
        if live and state.end_reason not in ("stop", "left") and state.model is not None:  # the finished drafter's real tau
            live.final(state.step, state.model, state.samples)
        plugs.stats["state"] = "done"
        reason = "done" if state.end_reason == "end_of_stream" else state.end_reason
        return state, dist
    except BaseException as e:
        if isinstance(e, Exception):  # why we leave, ahead of the bye (a signal's exit says nothing)
            link.report_failure(failure(e))
        if sink is not None:
            sink.close()
        if dist is not None:  # the caller's finally closes it only on success
            dist.close()
        raise
    finally:
        link.close(reason=reason)


def _sink(cfg: ConsumerConfig, run_id: str, run_dir: Path, rank: int):
    """The --tensorboard/--wandb writers of rank 0 (the step lines are the job's, alike on every rank)."""
    if not (cfg.tensorboard or cfg.wandb) or rank != 0:
        return None
    from dflash.runtime.sinks import open_sinks

    return open_sinks(cfg.tensorboard, cfg.wandb, run_id, run_dir, "train.step")


def _live_eval(cfg: ConsumerConfig, heads, signal_, rank: int, stats: dict | None) -> LiveEval | None:
    """The evaluator of --eval-every on rank 0 (it loads the whole target for --eval-prompts), or None."""
    if not cfg.eval_every or rank != 0:
        return None
    real = None
    if cfg.eval_prompts:
        real = RealTauSet.load(cfg.target, cfg.eval_prompts, device=heads.embed.device, dtype=heads.embed.dtype,
                               max_new_tokens=cfg.eval_max_new_tokens, limit=cfg.eval_limit)
    return LiveEval(heads, signal_, cfg.eval_every, rank=rank, stats=stats, real=real)


def _check_world(dist: Dist, run_config: RunConfig) -> None:
    """Ranks arranged outside the broker must agree with its --consumers, if it has one."""
    world = run_config.world_size
    if world and world != dist.world_size and not dist.elastic:
        raise DFlashError(f"this consumer is one of {dist.world_size} ranks (--dist-init/torchrun), but the broker "
                          f"arranges {world} (dflash-broker --consumers): use one or the other")


def _same_signal(dist: Dist, signal_) -> None:
    """Every rank trains one model: refuse ranks whose training signals differ."""
    mine = json.dumps(signal_.as_dict(), sort_keys=True)
    theirs = dist.broadcast_str(mine, max_bytes=8192)
    if theirs != mine:
        diffs = signal_differences(json.loads(theirs), signal_)
        raise SignalMismatch(f"rank {dist.rank}'s training signal differs from rank 0's ({'; '.join(diffs)}): "
                             "start every consumer of a run with the same training options")


def _json_config(cfg: ConsumerConfig) -> dict:
    d = as_dict(cfg)
    d["train"]["target_layers"] = list(cfg.train.target_layers) if cfg.train.target_layers else None
    return d


def _start_run(cfg: ConsumerConfig, tcfg: TrainConfig, dist: Dist) -> Path:
    """A local run's folder: logs, checkpoints, run.json; ranks share rank 0's run ID."""
    run_id = cfg.run_id or new_run_id()
    if dist.enabled and not cfg.run_id:
        run_id = dist.broadcast_str(run_id)
    if cfg.run_id and (run_folder(run_id, cfg.runs_dir) / "run.json").exists():
        # writing into another run's folder mixed two runs and broke its resume
        raise DFlashError(f"--run-id {run_id}: that run exists ({run_folder(run_id, cfg.runs_dir)}); a local run "
                          "writes only into a new run folder: leave out --run-id, or give a new ID "
                          "(to continue a run, --resume it)")
    run_dir = make_run_dir(run_id, cfg.runs_dir)
    bind_run(run_id, cfg.runs_dir)
    if dist.rank == 0:
        parent = Path(tcfg.resume).parent.parent.name if tcfg.resume else None
        write_run_json(run_dir, run_id, config=_json_config(cfg), parent_run=parent, resumed_from=tcfg.resume,
                       role="consumer", hosts=[hostname()], pid=os.getpid())
        point_latest(run_id, cfg.runs_dir, local=True)
    return run_dir
