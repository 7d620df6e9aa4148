"""The consumer's policy on its broker link (protocol/links.py `ConsumerLink`: inbox,
credit, acks, commits), as producers/link.py is the producer's.

- `hello_config`: what a consumer tells the broker (its training signal, and the
  rendezvous address it offers if it becomes rank 0: PROTOCOL.md 4.1);
- `await_run_facts`: the run's target layers, waited for when no producer fixed them yet;
- `run_layers`: the welcome's run facts against this drafter (fail before training);
- `resume_point`: the checkpoint to start from (a resumed run names it);
- `arranged_dist`: the data-parallel group the broker arranged (`--consumers N`): elastic
  (elastic.py, through the broker's torchft lighthouse) or a fixed torch.distributed group;
- `broker_batches`: the batch iterator `train()` reads: a message, None when nothing came
  in time (an empty step or a wait, never a hang), the end at `stop` once drained;
- `BrokerHooks`: ack after each step, commit after each checkpoint (rank 0), the queue
  and progress figures each `train.step` logs, the heartbeat's stats;
- `failure`: what a consumer that stops on an error tells the broker (`failed`), naming the
  batch when the batch is at fault.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import torch

from dflash.protocol.errors import DFlashError
from dflash.protocol.messages import Failed
from dflash.runtime.gpu import gpu_figures
from dflash.runtime.logs import get_logger
from dflash.runtime.run import is_run_id

from .batch import BatchMismatch
from .checkpoint import Signal, resolve_checkpoint
from .dist import Dist, DistGroup
from .elastic import ElasticDist, replica_name
from .train import Hooks, TrainConfig
from .train_config import TrainState

log = get_logger()

# Elastic consumers: how long a collective may wait for a peer, and a quorum for enough
# peers, before this consumer gives up (RankLost). A dead peer's collective fails at once
# (its connection closes); these bound a peer that hangs, or a host that vanished.
ELASTIC_COLLECTIVE_TIMEOUT_S = 300.0
ELASTIC_QUORUM_TIMEOUT_S = 60.0
# How long torchft keeps trying to reach the lighthouse (or a peer's Manager) before the
# quorum fails: the lighthouse dies with the broker, and a consumer must then exit (as it
# does when it finds the broker silent) rather than wait out the quorum timeout.
ELASTIC_CONNECT_TIMEOUT_S = 20.0

# How long a rank waits for a batch before it reports "nothing now" to the step's
# collective. Short enough that a starved rank delays a peer's step little; long enough
# that ranks with nothing to do meet about twice a second rather than spinning.
BATCH_WAIT_S = 0.5
# How many broker heartbeat intervals the first step waits for the run's planned samples.
PLAN_WAIT_BEATS = 3


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


def await_run_facts(link, run_config: dict, poll_s: float = 0.05) -> dict | None:
    """`run_config` (the welcome's) with the run's facts (target layers, hidden size, target
    identity) once a producer has fixed them: a consumer that joins before any producer waits
    here, in the broker's heartbeats, so that its drafter is never built on layers it guessed
    (the first batch would refuse it). None when the broker stops us first.

    A broker whose heartbeat carries no `run_facts` (older than this field) cannot tell:
    the batches are checked as they come, as before. Raises what the link raises (BrokerLost)."""
    if run_config.get("layer_ids") is not None:
        return run_config
    t0 = time.monotonic()
    log.info("consume.waiting_for_layers", hint="no producer has joined this run yet: the drafter is built once "
             "one states the target layers it captures")
    while True:
        if link.error is not None:
            raise link.error
        stats = link.broker_stats
        facts = stats.get("run_facts")
        if facts is None and stats:
            log.warning("consume.layers_unknown", hint="this broker does not send the run's facts in its heartbeat: "
                        "each batch's layers are checked against the drafter's as it comes")
            return run_config
        if facts and facts.get("layer_ids") is not None:
            known = {k: v for k, v in facts.items() if v is not None}
            log.info("consume.layers_known", layer_ids=list(known["layer_ids"]),
                     waited_s=round(time.monotonic() - t0, 2))
            return {**run_config, **known}
        if link.stopped.is_set():
            return None
        time.sleep(poll_s)


def run_layers(tcfg: TrainConfig, run_config: dict, hidden_size: int) -> TrainConfig:
    """`tcfg` with the run's target layers when this consumer left them to `auto`.

    Raises RunConfigMismatch when the run's producers send other layers than
    --target-layers asks for, or features of another width (another target)."""
    run_hidden = run_config.get("hidden_size")
    if run_hidden is not None and run_hidden != hidden_size:
        raise RunConfigMismatch(f"this run's target has hidden size {run_hidden}, --target here has {hidden_size}: "
                                "consumers must load the producers' target")
    layers = run_config.get("layer_ids")
    if layers is None:  # no producer yet: batches are checked as they come
        return tcfg
    if tcfg.target_layers is None:
        log.info("consume.layers_from_run", target_layers=list(layers))
        return replace(tcfg, target_layers=tuple(int(i) for i in layers))
    if list(tcfg.target_layers) != list(layers):
        raise RunConfigMismatch(f"--target-layers {','.join(map(str, tcfg.target_layers))} but this run's "
                                f"producers capture layers {','.join(map(str, layers))}: use the same layers "
                                "on both sides (or leave --target-layers auto)")
    return tcfg


def check_run_target(run_config: dict, identity: dict) -> None:
    """Raise RunConfigMismatch (naming both) when the run's target (`target_id`, stated by
    its producers) is not the one this consumer loaded. The broker refuses such a hello
    already; this covers a broker that does not check."""
    from dflash.protocol.target_id import describe_target, same_target

    theirs = run_config.get("target_id")
    if theirs is not None and not same_target(theirs, identity):
        raise RunConfigMismatch(f"this run's target is {describe_target(theirs)}, --target here is "
                                f"{describe_target(identity)}: consumers must load the producers' target")


def resume_point(ref: str | None, run_config: dict, runs_dir, run_id: str | None = None) -> str | None:
    """The checkpoint folder to start from, or None to start fresh.

    A resumed broker run names it (`resumed_from`: the newest commit of its chain,
    PROTOCOL.md 8): a newer checkpoint on disk holds samples the run makes again, so
    `latest` (or no --resume) means that one. Outside a resumed run, --resume as given,
    but (given this broker run's `run_id`) only a checkpoint of this run: see
    `fresh_run_resume`. Raises RunConfigMismatch for an explicit other checkpoint,
    FileNotFoundError."""
    if "resumed_from" not in run_config:
        if not ref:
            return None
        path = resolve_checkpoint(ref, runs_dir)
        if run_id is not None:
            fresh_run_resume(ref, path, run_id)
        return str(path)
    named = run_config["resumed_from"]
    want = resolve_checkpoint(named["checkpoint"], runs_dir).resolve() if named else None
    if ref not in (None, "latest"):
        have = resolve_checkpoint(ref, runs_dir).resolve()
        if have != want:
            raise RunConfigMismatch(f"--resume {ref} but this run continues run {run_config.get('parent_run')} "
                                    f"from {want or 'no checkpoint'}; leave out --resume (the broker says where)")
    log.info("consume.resume_point", checkpoint=str(want) if want else None, parent_run=run_config.get("parent_run"))
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


def arranged_dist(run_config: dict, device: torch.device, instance: str = "",
                  broker: str = "") -> DistGroup | None:
    """The data-parallel group the broker arranged (rank, world_size, dist or lighthouse in
    the welcome), or None if it arranges none. Elastic: joins the lighthouse at once.
    Fixed: blocks until every rank has joined (Dist.init's timeout). Raises DFlashError
    when ranks are arranged but rank 0 offered no rendezvous."""
    world = run_config.get("world_size")
    if not world:
        return None
    rank = int(run_config["rank"])
    if run_config.get("lighthouse"):
        host = urlsplit(broker).hostname
        return ElasticDist.join(lighthouse=run_config["lighthouse"], replica=replica_name(rank, instance),
                                host=reachable_ip(host) if host else socket.gethostname(), device=device,
                                rank=rank, max_world=int(world), timeout_s=ELASTIC_COLLECTIVE_TIMEOUT_S,
                                quorum_timeout_s=ELASTIC_QUORUM_TIMEOUT_S,
                                connect_timeout_s=ELASTIC_CONNECT_TIMEOUT_S)
    if world == 1:
        return Dist(0, 1, device)
    if not run_config.get("dist"):
        raise DFlashError(f"the broker arranges {world} ranks but rank 0 sent no dist_addr to meet at")
    log.info("consume.dist_join", rank=rank, world_size=world, dist=run_config["dist"],
             backend="nccl" if device.type == "cuda" else "gloo")
    return Dist.init(init_method=run_config["dist"], rank=rank, world_size=world, device=device)


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
        self.lineage: str | None = None  # of the weights: named in every ack and commit (record.py)
        self.hooks = Hooks(on_step=self.on_step, on_checkpoint=self.on_checkpoint, queue=self.queue,
                           progress=self.progress, plan=self.plan, stop=stop, stats=self.stats,
                           on_lineage=self.on_lineage, resume_point=self.resume_point)
        self.plan_waited = False

    def on_lineage(self, record) -> None:
        """The weights' lineage from now on; a new one (not a heal's) is announced before
        any ack names it, so the broker sends back to the pool what these weights lack."""
        if record.origin != "healed" and record.lineage != self.lineage:
            msg = record.lineage_message(self.resumed_from)
            log.info("consume.lineage", **msg.fields(), origin=record.origin)
            self.link.send_control(msg)
        self.lineage = record.lineage

    def resume_point(self) -> str | None:
        """The broker's newest commit as its latest heartbeat tells it (None: none yet)."""
        last = (self.link.broker_stats or {}).get("last_commit")
        checkpoint = last.get("checkpoint") if isinstance(last, dict) else None
        self.resumed_from = checkpoint or self.resumed_from
        return checkpoint

    def on_step(self, step: int, batch_ids: list[str]) -> None:
        self.link.ack(batch_ids, step, self.lineage)

    def on_checkpoint(self, step: int, path) -> None:
        path = str(Path(path).resolve())  # a resumed run's consumers load it from any cwd
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
        """The samples this run plans to train: the broker's samples_total (epochs x
        samples) less those skipped (bad rows: never trained), from its heartbeat.

        A batch exists only once a producer fixed the dataset size, and the broker's next
        heartbeat carries it: the first call (the first step) waits for that heartbeat
        (a few heartbeat intervals at most) rather than start the run without a plan."""
        stats = self.link.broker_stats
        if stats.get("samples_total") is None and not self.plan_waited:
            self.plan_waited = True
            beat = float((getattr(self.link, "welcome", None) or {}).get("heartbeat_s") or 1.0)
            deadline = time.monotonic() + PLAN_WAIT_BEATS * beat
            while stats.get("samples_total") is None and time.monotonic() < deadline:
                time.sleep(0.02)
                stats = self.link.broker_stats
        total = stats.get("samples_total")
        return None if total is None else max(0, int(total) - int(stats.get("samples_skipped") or 0))

    def heartbeat(self) -> dict:
        """Heartbeat stats (PROTOCOL.md 4.2). Runs on the link's I/O thread: a C-level
        dict copy, never iteration over a dict the training thread updates."""
        out = dict(self.stats)
        out["prefetched"] = self.link.prefetched()
        out.update(gpu_figures(self.device))  # memory (+ utilisation with NVML); {} on CPU; never raises
        return out
