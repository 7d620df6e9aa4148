"""One producer process, given its `ProducerConfig` (produce_command.py makes it from the
options): load the target and data (build.py), then serve the broker's leases, or with
`--tensor-parallel` follow rank 0's forward passes on a rank other than 0. `--dry-run`: no broker."""

from __future__ import annotations

import traceback

import click

from dflash.protocol.curve import client_from
from dflash.runtime.command_line import as_dict, default_instance, fail
from dflash.protocol.errors import DFlashError
from dflash.runtime.fdlimit import raise_open_files
from dflash.runtime.logs import close_logging, get_logger, setup_logging
from dflash.protocol.peer import BrokerLost, exit_broker_lost, exit_when_stuck
from dflash.runtime.stop import GracefulStop

from .build import hello_config, load_components, make_producer
from .producer_config import ProducerConfig
from .producer import LocalWorkSource
from .target import resolve_device

log = get_logger()


def run(cfg: ProducerConfig) -> None:
    """Produce until the broker has no work left, a signal stops us, or the dry run ends;
    exits non-zero with a one-line reason on failure (2: bad input found at start-up)."""
    if not cfg.tensor_parallel:
        return _run(cfg, None)
    from . import shard

    world = _join_world(cfg)
    shard.run_then_exit(lambda: _run(cfg, world))


def _run(cfg: ProducerConfig, world) -> None:
    instance = cfg.instance or _default_instance(cfg)
    if world is not None and not world.leader:
        return _follow(cfg, world, f"{instance}-rank{world.rank}")
    setup_logging("producer", instance, gpu=cfg.gpu, level=cfg.log_level)
    log.info("produce.start", config=as_dict(cfg))
    raise_open_files("producer")
    if world is not None:
        log.info("produce.sharded", world_size=world.size, backend=world.backend, tp_plan="auto")
    components = None
    try:
        try:
            components = load_components(cfg)
            summary = _dry_run(cfg, components) if cfg.dry_run else _serve(cfg, components, instance)
        finally:
            if components is not None and components.target.shard is not None:
                components.target.shard.stop()  # the followers leave their loop (every exit path)
            if world is not None:
                from . import shard

                shard.close()
    except (DFlashError, ValueError, FileNotFoundError, OSError) as e:
        # PROTOCOL.md 4.2: a silent broker is logged as `*.broker_lost`
        log.error("produce.broker_lost" if isinstance(e, BrokerLost) else "produce.failed",
                  error=f"{type(e).__name__}: {e}")
        if isinstance(e, BrokerLost):
            exit_broker_lost(e)
        close_logging()
        fail(str(e), code=1)
    except Exception as e:  # a bug or a library failure: still the run's log says why we died
        log.error("produce.failed", error=f"{type(e).__name__}: {str(e)[:2000]}", traceback=traceback.format_exc())
        close_logging()
        raise
    log.info("produce.done", **summary)
    close_logging()


def _default_instance(cfg: ProducerConfig) -> str:
    """`<host>-<device>-<pid>` (PROTOCOL.md 4.1)."""
    try:
        device = resolve_device(cfg.gpu, cfg.device)
    except ValueError as e:
        fail(str(e))
    if cfg.tensor_parallel and device.type == "cuda":
        import torch

        device = torch.device("cuda", torch.cuda.current_device())  # this rank's (_join_world set it)
    return default_instance(f"cuda{device.index or 0}" if device.type == "cuda" else device.type)


def _join_world(cfg: ProducerConfig):
    """--tensor-parallel: join this torchrun launch's process group, on this rank's device."""
    from . import shard

    try:
        device = resolve_device(None, cfg.device)
        world = shard.init(device)
        shard.rank_device(world, device)
    except ValueError as e:  # ShardError, TargetError
        fail(str(e))
    return world


def _follow(cfg: ProducerConfig, world, instance: str) -> None:
    """A rank other than 0: load its shard, then follow rank 0's passes. No broker, data or run logs."""
    from . import shard
    from .target import load_target

    setup_logging("producer", instance, gpu=cfg.gpu, level=cfg.log_level)
    try:
        device = resolve_device(None, cfg.device)
        device = shard.rank_device(world, device)
        target = load_target(cfg.target, cfg.target_layers, device=device, dtype=cfg.dtype, attn_impl=cfg.attn_impl,
                             full=cfg.regenerate, final=cfg.final_hidden, trust_remote_code=cfg.trust_remote_code,
                             tensor_parallel=True)
        passes = shard.follow(target)
    except (DFlashError, ValueError, OSError) as e:
        log.error("produce.failed", error=f"{type(e).__name__}: {e}", rank=world.rank)
        close_logging()
        fail(str(e), code=1)
    finally:
        shard.close()
    log.info("produce.follower_done", rank=world.rank, passes=passes)
    close_logging()


def _dry_run(cfg: ProducerConfig, c) -> dict:
    n = len(c.dataset) if cfg.limit is None else min(cfg.limit, len(c.dataset))
    source = LocalWorkSource(n, cfg.lease_size)
    device = c.target.device
    if device.type == "cuda":  # the peak is the figure that sizes --token-budget
        import torch

        weights = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    summary = make_producer(cfg, c, source, lambda batch: None).run()
    if device.type == "cuda":
        summary["gpu_weights_gib"] = round(weights / 2**30, 2)
        summary["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    click.echo(" ".join(f"{k}={v}" for k, v in summary.items()), err=True)
    return summary


def _serve(cfg: ProducerConfig, c, instance: str) -> dict:
    """Connect to the broker, produce until no work is left or a signal stops us, leave."""
    from dflash.protocol.links import ProducerLink

    from .broker_work import BrokerWorkSource, Stopped, failure, link_sink

    producer = None
    link = ProducerLink(cfg.broker, instance, gpu=cfg.gpu, config=hello_config(c, cfg),
                        curve=client_from(cfg.curve_keys, cfg.curve_name),
                        runs_dir=cfg.runs_dir, stats=lambda: producer.stats() if producer else {"state": "starting"},
                        on_lost=exit_when_stuck("producer"))
    link.start()  # until we are welcome, a signal ends us at once: nothing is ours to hand back
    # First SIGINT/SIGTERM: finish the batch in hand, say bye (the broker takes back our
    # leases), exit 0. Second: die (PROTOCOL.md 4.6).
    stop = GracefulStop().install()
    reason, flush_s = "failed", 60.0
    try:
        producer = make_producer(cfg, c, BrokerWorkSource(link, cfg.lease_size, stop), link_sink(link, stop),
                                 name=link.peer_id)
        producer.stop = stop
        link.on_revoke = producer.prefetcher.revoke
        try:
            summary = producer.run()
        except Stopped:
            summary = producer.summary()
        reason = "done"
        if stop.is_set():
            # unproduced leases go back with `bye` (PROTOCOL.md 6): not worth holding the exit for
            reason, flush_s = f"signal {stop.signal_name}", 5.0
            log.warning("produce.stopped", signal=stop.signal_name, **summary)
        return summary
    except Exception as e:
        link.report_failure(failure(e))  # why we leave, ahead of the bye
        raise
    finally:
        link.close(reason=reason, flush_timeout_s=flush_s)
        stop.restore()
