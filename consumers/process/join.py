"""Joining the broker's run as a consumer (the steps before `train()`, consumer_process.py
`_serve` calls them in order): the hello, the resume point, the run's facts checked against
this drafter (failing before training), and the data-parallel group the broker arranged."""

from __future__ import annotations

import socket
import time
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import torch

from dflash.consumers.checkpoints.checkpoint import nothing_to_resume, resolve_checkpoint
from dflash.consumers.parallel.dist import Dist, DistGroup
from dflash.consumers.parallel.elastic import ElasticDist, replica_name
from dflash.consumers.training.config import TrainConfig
from dflash.protocol.errors import DFlashError, ProtocolError
from dflash.protocol.messages import RunConfig, RunFacts
from dflash.protocol.fields import nested
from dflash.protocol.training_signal import Signal
from dflash.runtime.logs import get_logger
from dflash.runtime.run import is_run_id

log = get_logger()

# Elastic: a collective's and a quorum's wait for peers. The quorum waits longer: a peer hung in a
# collective still heartbeats, and by torchft's split-brain rule survivors form no quorum without it
# until its collective times out.
ELASTIC_COLLECTIVE_TIMEOUT_S = 300.0
ELASTIC_QUORUM_TIMEOUT_S = ELASTIC_COLLECTIVE_TIMEOUT_S + 60.0
ELASTIC_CONNECT_TIMEOUT_S = 20.0  # the lighthouse dies with the broker: exit, not wait out the quorum

class RunConfigMismatch(DFlashError):
    """The broker's run (its producers' target) does not fit this drafter."""


def hello_config(signal: Signal, dist_addr: str | None, auto_layers: bool = False,
                 group: tuple[int, int] | None = None) -> dict:
    """`hello.config` of a consumer (PROTOCOL.md 4.1): its signal, `dist_addr` offered as rank 0, `group`."""
    # lineages (PROTOCOL.md 4.5): the broker can take us in after the job's last consumer died
    cfg = {"signal": {**signal.as_dict(), **({"target_layers": None} if auto_layers else {})}, "lineages": True}
    if dist_addr:
        cfg["dist_addr"] = dist_addr
    if group is not None:
        cfg["group"] = {"rank": group[0], "world_size": group[1]}
    return cfg


def offer_dist_addr(broker: str) -> str:
    """'host:port' for other ranks if we become rank 0: the interface that reaches the broker
    (the other consumers reach it too) and a port free now."""
    host = urlsplit(broker).hostname
    if not host:
        raise DFlashError(f"--broker {broker!r}: expected tcp://HOST[:PORT]")
    ip = reachable_ip(host)
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{ip}:{port}"


def reachable_ip(host: str) -> str:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks the route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def run_config_of(link) -> RunConfig:
    """The welcome's run facts; ProtocolError if none (nothing to check the drafter against)."""
    if link.welcome.run_config is None:
        raise ProtocolError("welcome: no run_config (the run's facts, PROTOCOL.md 4.1): a consumer needs them",
                            peer="broker")
    return link.welcome.run_config


def await_run_facts(link, run_config: RunConfig, poll_s: float = 0.05) -> RunConfig | None:
    """`run_config` with the run's facts once a producer fixed them (a consumer ahead of every
    producer waits, never building on guessed layers); None if stopped first. An older broker
    without `run_facts`: batches are checked as they come."""
    if run_config.layer_ids is not None:
        return run_config
    t0 = time.monotonic()
    log.info("consume.waiting_for_layers", hint="no producer has joined this run yet: the drafter is built once "
             "one states the target layers it captures")
    while True:
        if link.error is not None:
            raise link.error
        stats = link.broker_stats
        if "run_facts" not in stats and stats:
            log.warning("consume.layers_unknown", hint="this broker does not send the run's facts in its heartbeat: "
                        "each batch's layers are checked against the drafter's as it comes")
            return run_config
        facts = _run_facts(stats.get("run_facts"))
        if facts is not None and facts.layer_ids is not None:
            log.info("consume.layers_known", layer_ids=list(facts.layer_ids), waited_s=round(time.monotonic() - t0, 2))
            return run_config.with_facts(facts)
        if link.stopped.is_set():
            return None
        time.sleep(poll_s)


def _run_facts(value) -> RunFacts | None:
    try:
        return nested(RunFacts)(value)
    except ProtocolError as e:
        raise ProtocolError(f"heartbeat: stats.run_facts {e.reason}", peer="broker") from None


def run_layers(tcfg: TrainConfig, run_config: RunConfig, hidden_size: int) -> TrainConfig:
    """`tcfg` with the run's target layers when left to `auto`; RunConfigMismatch on other layers or width."""
    run_hidden = run_config.hidden_size
    if run_hidden is not None and run_hidden != hidden_size:
        raise RunConfigMismatch(f"this run's target has hidden size {run_hidden}, --target here has {hidden_size}: "
                                "consumers must load the producers' target")
    layers = run_config.layer_ids
    if layers is None:  # no producer yet: batches are checked as they come
        return tcfg
    if tcfg.target_layers is None:
        log.info("consume.layers_from_run", target_layers=list(layers))
        return replace(tcfg, target_layers=tuple(layers))
    if list(tcfg.target_layers) != list(layers):
        raise RunConfigMismatch(f"--target-layers {','.join(map(str, tcfg.target_layers))} but this run's "
                                f"producers capture layers {','.join(map(str, layers))}: use the same layers "
                                "on both sides (or leave --target-layers auto)")
    return tcfg


def check_run_target(run_config: RunConfig, identity: dict) -> None:
    """RunConfigMismatch when the run's target is not the one loaded (for a broker that does not check)."""
    from dflash.protocol.target_id import describe_target, same_target

    theirs = run_config.target_id
    if theirs is not None and not same_target(theirs, identity):
        raise RunConfigMismatch(f"this run's target is {describe_target(theirs)}, --target here is "
                                f"{describe_target(identity)}: consumers must load the producers' target")


def resume_point(ref: str | None, run_config: RunConfig, runs_dir, run_id: str | None = None) -> str | None:
    """The checkpoint folder to start from, or None to start fresh. A resumed broker run's
    `resumed_from` wins (a newer one on disk holds samples the run makes again)."""
    if not run_config.names_start():
        if not ref:
            return None
        if why := nothing_to_resume(ref, runs_dir):
            log.info("consume.resume_point", checkpoint=None, parent_run=None, why=why)
            return None
        path = resolve_checkpoint(ref, runs_dir)
        if run_id is not None:
            fresh_run_resume(ref, path, run_id)
        return str(path)
    named = run_config.resumed_from
    want = resolve_checkpoint(named.checkpoint, runs_dir).resolve() if named else None
    if ref not in (None, "latest"):
        have = resolve_checkpoint(ref, runs_dir).resolve()
        if have != want:
            raise RunConfigMismatch(f"--resume {ref} but this run continues run {run_config.parent_run} "
                                    f"from {want or 'no checkpoint'}; leave out --resume (the broker says where)")
    log.info("consume.resume_point", checkpoint=str(want) if want else None, parent_run=run_config.parent_run)
    return str(want) if want else None


def fresh_run_resume(ref: str, path: Path, run_id: str) -> None:
    """Refuse another run's checkpoint in a fresh broker run: its record would skip every sample as
    held and the run would end with nothing trained. Continuing is `dflash-broker --resume`'s call."""
    owner = path.parent.parent.name if path.parent.name == "checkpoints" else None
    if owner == run_id:
        return  # ours: written before its commit reached the broker (RELIABILITY.md 4)
    where = f"checkpoint of run {owner}" if owner and is_run_id(owner) else "checkpoint outside any run folder"
    hint = f"dflash-broker --resume {owner}" if owner and is_run_id(owner) else "dflash-broker --resume RUN"
    raise RunConfigMismatch(f"--resume {ref} is {path}, a {where}, but this broker run {run_id} is a fresh run "
                            f"with its own ledger: that checkpoint's samples would all be skipped as already "
                            f"trained. To continue that run, stop this broker and start {hint} (consumers "
                            "then need no --resume); to train this run from scratch, leave out --resume")


def arranged_dist(run_config: RunConfig, device: torch.device, instance: str = "",
                  broker: str = "") -> DistGroup | None:
    """The data-parallel group the broker arranged, or None. Elastic joins the lighthouse at once;
    fixed blocks until every rank has joined."""
    world = run_config.world_size
    if not world:
        return None
    rank = run_config.rank
    if rank is None:
        raise ProtocolError(f"welcome: run_config arranges {world} ranks (world_size) but names no rank",
                            peer="broker")
    if run_config.lighthouse:
        host = urlsplit(broker).hostname
        return ElasticDist.join(lighthouse=run_config.lighthouse, replica=replica_name(rank, instance),
                                host=reachable_ip(host) if host else socket.gethostname(), device=device,
                                rank=rank, max_world=world, timeout_s=ELASTIC_COLLECTIVE_TIMEOUT_S,
                                quorum_timeout_s=ELASTIC_QUORUM_TIMEOUT_S,
                                connect_timeout_s=ELASTIC_CONNECT_TIMEOUT_S)
    if world == 1:
        return Dist(0, 1, device)
    if not run_config.dist:
        raise DFlashError(f"the broker arranges {world} ranks but rank 0 sent no dist_addr to meet at")
    log.info("consume.dist_join", rank=rank, world_size=world, dist=run_config.dist,
             backend="nccl" if device.type == "cuda" else "gloo")
    return Dist.init(init_method=run_config.dist, rank=rank, world_size=world, device=device)
