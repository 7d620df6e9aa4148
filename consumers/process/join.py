"""Joining the broker's run as a consumer (the steps before `train()`, consumer_process.py
`_serve` calls them in order):

- `hello_config`: what a consumer tells the broker (its training signal, and the
  rendezvous address it offers if it becomes rank 0: PROTOCOL.md 4.1);
- `resume_point`: the checkpoint to start from (a resumed run names it);
- `run_config_of`: the welcome's run facts (protocol/messages.py `RunConfig`);
- `await_run_facts`: the run's target layers, waited for when no producer fixed them yet;
- `check_run_target`, `run_layers`: the welcome's run facts against this drafter (fail
  before training);
- `arranged_dist`: the data-parallel group the broker arranged (`--consumers N`): elastic
  (parallel/elastic.py, through the broker's torchft lighthouse) or a fixed torch.distributed group.
"""

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

# Elastic consumers: how long a collective may wait for a peer, and a quorum for enough
# peers, before this consumer gives up (RankLost). These bound a peer that hangs, or a host
# that vanished. The quorum waits longer than a collective: a peer left hanging in a
# collective still heartbeats, and by torchft's split-brain rule its survivors form no
# quorum without it until its collective times out and it joins them; a shorter quorum
# timeout would end those survivors instead (seen when a peer was SIGKILLed mid-step).
ELASTIC_COLLECTIVE_TIMEOUT_S = 300.0
ELASTIC_QUORUM_TIMEOUT_S = ELASTIC_COLLECTIVE_TIMEOUT_S + 60.0
# How long torchft keeps trying to reach the lighthouse (or a peer's Manager) before the
# quorum fails: the lighthouse dies with the broker, and a consumer must then exit (as it
# does when it finds the broker silent) rather than wait out the quorum timeout.
ELASTIC_CONNECT_TIMEOUT_S = 20.0

class RunConfigMismatch(DFlashError):
    """The broker's run (its producers' target) does not fit this drafter."""


def hello_config(signal: Signal, dist_addr: str | None, auto_layers: bool = False,
                 group: tuple[int, int] | None = None) -> dict:
    """`hello.config` of a consumer: its training signal (target layers nil when they are
    left to the run), `dist_addr` for the broker to hand the other ranks if we are rank 0,
    and `group` {rank, world_size} when the ranks are arranged outside the broker."""
    # lineages: this consumer announces the lineage of its weights (PROTOCOL.md 4.5), so the
    # broker can take it in after the job's last consumer died (it sends back what is lost)
    cfg = {"signal": {**signal.as_dict(), **({"target_layers": None} if auto_layers else {})}, "lineages": True}
    if dist_addr:
        cfg["dist_addr"] = dist_addr
    if group is not None:
        cfg["group"] = {"rank": group[0], "world_size": group[1]}
    return cfg


def offer_dist_addr(broker: str) -> str:
    """'host:port' other ranks can dial if this consumer becomes rank 0: the address of
    the interface that reaches the broker (other consumers reach the broker too) and a
    port free now. Raises DFlashError if the broker address has no host."""
    host = urlsplit(broker).hostname
    if not host:
        raise DFlashError(f"--broker {broker!r}: expected tcp://HOST[:PORT]")
    ip = reachable_ip(host)
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{ip}:{port}"


def reachable_ip(host: str) -> str:
    """This host's address on the interface that reaches `host` (the broker's)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks the route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def run_config_of(link) -> RunConfig:
    """The welcome's run facts. Raises ProtocolError when the broker sent none: a consumer
    cannot check its drafter against a run it knows nothing of."""
    if link.welcome.run_config is None:
        raise ProtocolError("welcome: no run_config (the run's facts, PROTOCOL.md 4.1): a consumer needs them",
                            peer="broker")
    return link.welcome.run_config


def await_run_facts(link, run_config: RunConfig, poll_s: float = 0.05) -> RunConfig | None:
    """`run_config` (the welcome's) with the run's facts (target layers, hidden size, target
    identity) once a producer has fixed them: a consumer that joins before any producer waits
    here, in the broker's heartbeats, so that its drafter is never built on layers it guessed
    (the first batch would refuse it). None when the broker stops us first.

    A broker whose heartbeat carries no `run_facts` (older than this field) cannot tell:
    the batches are checked as they come, as before. Raises what the link raises (BrokerLost),
    ProtocolError for `run_facts` that are not what PROTOCOL.md 4.2 says."""
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
    """The heartbeat's `stats.run_facts` (nil while the broker knows none)."""
    try:
        return nested(RunFacts)(value)
    except ProtocolError as e:
        raise ProtocolError(f"heartbeat: stats.run_facts {e.reason}", peer="broker") from None


def run_layers(tcfg: TrainConfig, run_config: RunConfig, hidden_size: int) -> TrainConfig:
    """`tcfg` with the run's target layers when this consumer left them to `auto`.

    Raises RunConfigMismatch when the run's producers send other layers than
    --target-layers asks for, or features of another width (another target)."""
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
    """Raise RunConfigMismatch (naming both) when the run's target (`target_id`, stated by
    its producers) is not the one this consumer loaded. The broker refuses such a hello
    already; this covers a broker that does not check."""
    from dflash.protocol.target_id import describe_target, same_target

    theirs = run_config.target_id
    if theirs is not None and not same_target(theirs, identity):
        raise RunConfigMismatch(f"this run's target is {describe_target(theirs)}, --target here is "
                                f"{describe_target(identity)}: consumers must load the producers' target")


def resume_point(ref: str | None, run_config: RunConfig, runs_dir, run_id: str | None = None) -> str | None:
    """The checkpoint folder to start from, or None to start fresh.

    A resumed broker run names it (`resumed_from`: the newest commit of its chain,
    PROTOCOL.md 8): a newer checkpoint on disk holds samples the run makes again, so
    `latest` (or no --resume) means that one. Outside a resumed run, --resume as given,
    but (given this broker run's `run_id`) only a checkpoint of this run: see
    `fresh_run_resume`. Raises RunConfigMismatch for an explicit other checkpoint,
    FileNotFoundError."""
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
    """Refuse a checkpoint of another run (or of no run) in a broker run that neither
    continues a run nor has committed: its ledger never saw what that checkpoint trained,
    so it makes those samples again, and the checkpoint's record holds them: every one
    would be skipped as held (`train.skip_held`) and acked, and the run would end
    "every sample trained" with nothing trained. Continuing a run is the broker's call
    (`dflash-broker --resume`), which names the checkpoint to every consumer."""
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
    """The data-parallel group the broker arranged (rank, world_size, dist or lighthouse in
    the welcome), or None if it arranges none. Elastic: joins the lighthouse at once.
    Fixed: blocks until every rank has joined (Dist.init's timeout). Raises DFlashError
    when ranks are arranged but rank 0 offered no rendezvous, ProtocolError when the broker
    arranges ranks without saying ours."""
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
