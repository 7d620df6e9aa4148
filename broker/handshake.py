"""`hello` -> `welcome` or `reject` (PROTOCOL.md 4.1).

Checks, in order: role, a retried hello on the same connection, instance name unique
among live peers of the role, producer config against the run's facts (the first
producer fixes them), consumer rank and data-out pipe. Only then is a peer ID spent.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from dflash.protocol.messages import CommitPoint, DatasetFacts, RunConfig, Stop, Welcome
from dflash.protocol.target_id import describe_target, same_target
from dflash.runtime.logs import get_logger

from . import runinfo
from .config import MAX_CREDIT, MAX_HELLO_CONFIG_BYTES
from .inbound import Hello
from .peers import Peer
from .phase import Phase
from .replies import refuse

if TYPE_CHECKING:  # the core calls these with itself; imported for the annotations only
    from .core import BrokerCore

log = get_logger()

FACT_KEYS = ("target", "layer_ids", "hidden_size")
# Facts a producer states that are kept once known: target_id is checked by target_mismatch,
# vocab_size against the run's when a producer states it (intake checks token IDs with it).
KEPT_KEYS = ("target_id", "vocab_size")
COUNT_KEYS = ("hidden_size", "vocab_size")  # facts that must be positive counts when stated


def hello(core: BrokerCore, identity: bytes, m: Hello, key: str | None = None) -> None:
    """`key`: the authorised Curve key's name this connection used (None without Curve)."""
    role, instance, config, h = m.role, m.instance, m.config, m.raw
    if role not in ("producer", "consumer"):
        return refuse(core, identity, "bad_message", f"role {role!r}: hello is for 'producer' or 'consumer'", h)
    if not instance or len(instance) > 128 or not isinstance(config, dict):
        return refuse(core, identity, "bad_message",
                      "hello needs a non-empty instance (<=128 chars) and a map config", h)
    if len(json.dumps(config, default=str)) > MAX_HELLO_CONFIG_BYTES:
        return refuse(core, identity, "bad_message", f"hello config is larger than {MAX_HELLO_CONFIG_BYTES} bytes "
                      "as JSON", {**h, "config": None})
    same = core.peers.by_identity.get(identity)
    if same is not None:
        if same.role == role and same.instance == instance:
            return welcome(core, same)  # the peer retried its hello: give the same answer
        return refuse(core, identity, "bad_message", f"this connection already joined as {same.id}", h)
    if len(core.peers.by_id) >= core.cfg.max_peers:  # every session costs memory: a flood of hellos must not
        return refuse(core, identity, "full", f"{core.cfg.max_peers} live peers already (--max-peers)", h)
    other = core.peers.instance_taken(role, instance)
    if other is not None and same_process(other, m, key):
        return reconnected(core, other, identity)
    if other is not None:
        return refuse(core, identity, "duplicate_instance",
                      f"a live {role} is already named {instance!r} ({other.id} on {other.host}, pid "
                      f"{other.pid}); give this one another name (--instance)", h)
    if role == "consumer" and core.phase is Phase.JOB_LOST and not takes_over(core, config):
        return refuse(core, identity, "job_lost", job_lost_reason(core), h)
    facts, rank = None, None
    wrong_target = target_mismatch(core, role, config)
    if wrong_target is not None:
        return refuse(core, identity, "config_mismatch", wrong_target, h)
    if role == "producer":
        facts = producer_facts(core.facts, config)
        if isinstance(facts, str):
            return refuse(core, identity, "config_mismatch", facts, h)
    else:
        other = None if core.cfg.consumers else second_model(core, config)
        if other is not None:
            return refuse(core, identity, "full", f"this broker arranges no data-parallel ranks (--consumers 0) and "
                          f"consumer {other.id} ({other.instance} on {other.host}) is training already: another "
                          "consumer would train a separate model into the same run; start the broker with "
                          "--consumers N to train N consumers as one model", h)
        if core.cfg.consumers:
            rank = core.peers.next_rank(core.cfg.consumers)
            if rank is None:
                return refuse(core, identity, "full", f"all {core.cfg.consumers} ranks (--consumers) are held by live "
                              "consumers", h)
        opened = open_pipes(core)
        if opened is None:
            lo, hi = core.cfg.data_out_ports
            return refuse(core, identity, "full", f"not {core.streams} free data-out port(s) in {lo}-{hi} "
                          f"(--data-out-ports; {core.streams} per consumer, --data-streams)", h)
        pipes, threads, ports = opened
    p = core.peers.add(role, identity, h)
    p.curve_key = key
    if role == "producer":
        set_facts(core, facts, p.id)
    else:
        p.pipes, p.pipe_threads, p.ports, p.rank = pipes, threads, ports, rank
        p.data_streams = [f"tcp://{core.advertise}:{port}" for port in ports]
        p.data_out = p.data_streams[0]
        if rank == 0:
            core.dist = dist_endpoint(config.get("dist_addr"))
    core.ledger.peer_joined(p)
    log.info("broker.peer_joined", **p.describe(), rank=p.rank, data_out=p.data_out,
             data_streams=p.data_streams or None, config=_brief(config),
             curve_key=key)
    welcome(core, p)
    if core.end is not None:  # joined after end of stream (or during a shutdown): nothing left to do
        core.end.told.add(p.id)
        core.send(p.identity, Stop(core.end.reason))


def same_process(p: Peer, m: Hello, key: str | None) -> bool:
    """Whether a hello comes from the very process of live session `p`, on a new
    connection: same role and instance, host and pid, and the same Curve key. A DEALER
    that reconnects (ZeroMQ closed its connection, e.g. for a frame over the control limit)
    gets a new ROUTER identity unless it set one, and its old connection is gone: a pid
    lives on one host once, so that session cannot be answering anyone else."""
    return m.host == p.host and m.pid == p.pid and isinstance(m.pid, int) and p.curve_key == key


def reconnected(core: BrokerCore, p: Peer, identity: bytes) -> None:
    """Move session `p` to its new connection (same peer ID, leases, credit, pipes) and
    welcome it again; logged as broker.peer_reconnected."""
    old = p.identity
    core.peers.by_identity.pop(old, None)
    p.identity = identity
    core.peers.by_identity[identity] = p
    log.warning("broker.peer_reconnected", **p.describe(), old_identity=old.hex()[:64], identity=identity.hex()[:64],
                hint="its control connection was closed and reopened (a network reset, or a frame over the "
                     "control limit)")
    welcome(core, p)
    if core.end is not None and p.id in core.end.told:
        core.send(p.identity, Stop(core.end.reason))


def welcome(core: BrokerCore, p: Peer) -> None:
    facts, resume, ranks = core.facts, {}, {}
    if core.parent is not None:  # consumers load this checkpoint, not a newer one (PROTOCOL.md 8)
        resume = {"parent_run": core.parent.run_id, "resumed_from": core.parent.resumed_from}
    if core.ledger.last_commit is not None:  # a consumer joining later starts from this run's newest commit
        step, checkpoint = core.ledger.last_commit
        resume["resumed_from"] = {"run": core.run_id, "step": step, "checkpoint": checkpoint}
    if p.role == "producer":
        # The same endpoint once per connection to open: their batches in spread over the
        # broker's I/O threads for batches in (one thread is a ceiling: docs/BENCHMARKS.md).
        data_in = core.endpoints["data_in"]
        data = {"data_in": data_in, "data_streams": [data_in] * core.producer_streams}
    else:
        data = {"data_out": p.data_out, "data_streams": p.data_streams}
        if core.cfg.consumers:  # elastic (a lighthouse): world_size is the most at once
            ranks = {"rank": p.rank, "world_size": core.cfg.consumers, "dist": core.dist, "lighthouse": core.lighthouse}
    dataset, start = facts.get("dataset"), resume.get("resumed_from")
    run_config = RunConfig(
        core.cfg.epochs, core.cfg.seed, core.cfg.lease_size, core.cfg.max_message_bytes, MAX_CREDIT,
        target=facts.get("target"), target_id=facts.get("target_id"), layer_ids=facts.get("layer_ids"),
        hidden_size=facts.get("hidden_size"), vocab_size=facts.get("vocab_size"),
        dataset=DatasetFacts(dataset["n_samples"], dataset.get("fingerprint")) if dataset else None,
        parent_run=resume.get("parent_run"),
        resumed_from=CommitPoint(start["run"], start["step"], start["checkpoint"]) if start else None, **ranks)
    core.send(p.identity, Welcome(core.run_id, p.id, core.cfg.heartbeat_s, core.cfg.timeout_s, run_config=run_config,
                                  **data))


def second_model(core: BrokerCore, config: dict):
    """With --consumers 0 the broker arranges no ranks, so a run trains one model: a live
    drafter trainer (its hello carries config.signal) that a new one would not train with.
    Ranks the consumers arranged themselves (config.group {rank, world_size}, the same
    world_size, distinct ranks) are one model. Returns that live consumer, or None."""
    if "signal" not in config:  # not a drafter trainer (a data client, a test's fake)
        return None
    mine = config.get("group") if isinstance(config.get("group"), dict) else None
    for other in core.peers.live("consumer"):
        if "signal" not in other.config:
            continue
        theirs = other.config.get("group") if isinstance(other.config.get("group"), dict) else None
        same_group = (mine is not None and theirs is not None and mine.get("world_size") == theirs.get("world_size")
                      and mine.get("rank") != theirs.get("rank"))
        if not same_group:
            return other
    return None


def takes_over(core: BrokerCore, config: dict) -> bool:
    """An elastic run's consumer that announces its lineage (config.lineages) may join after
    the job died: starting from the newest commit, its `lineage` message sends what only the
    dead weights held back to the lease pool (control.on_lineage), and the producers are
    still there to make it (an elastic run keeps them until end of stream)."""
    return core.lighthouse is not None and config.get("lineages") is True


def job_lost_reason(core: BrokerCore) -> str:
    lost = core.job_lost
    return (f"this run's training job ended with {lost.trained} trained samples not committed (its last "
            f"consumer {lost.peer} {lost.state}: {lost.reason[:80]}); only the weights that died with "
            f"it held them, and this run will not make them again: stop the run and restart it with "
            f"dflash-broker --resume {core.run_id}")


def target_mismatch(core: BrokerCore, role: str, config: dict) -> str | None:
    """Why this peer's target is not the run's, or None. The run's `target_id` is fixed by
    its first producer; before one came, a producer is checked against the live
    consumers' targets (a consumer states its own in `config.signal.target`)."""
    if role == "producer":
        mine = config.get("target_id")
        if core.facts.get("target_id") is not None:
            theirs, whose = core.facts["target_id"], "this run's target (its first producer's)"
        else:
            other = next((c for c in core.peers.live("consumer")
                          if _consumer_target(c.config) is not None and mine is not None
                          and not same_target(_consumer_target(c.config), mine)), None)
            if other is None:
                return None
            theirs, whose = _consumer_target(other.config), f"live consumer {other.id}'s target"
    else:
        mine, theirs = _consumer_target(config), core.facts.get("target_id")
        whose = "this run's target (its producers')"
        if theirs is None or mine is None:
            return None
    if same_target(mine, theirs):
        return None
    return (f"this {role}'s --target is {describe_target(mine)}, {whose} is {describe_target(theirs)}: every "
            "producer and consumer of a run must load the same target model")


def _consumer_target(config: dict):
    signal = config.get("signal")
    return signal.get("target") if isinstance(signal, dict) else None


def producer_facts(facts: dict, config: dict) -> dict | str:
    """The run's facts with this producer's added, or why it does not fit the run."""
    ds = config.get("dataset") if isinstance(config.get("dataset"), dict) else {}
    n, fp = ds.get("n_samples"), ds.get("fingerprint")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        return f"config.dataset.n_samples {n!r} is not a count"
    known = facts.get("dataset")
    if known is None and n is None:
        return "the first producer must send config.dataset.n_samples (or start the broker with --num-samples)"
    if known is not None:
        if n is not None and n != known["n_samples"]:
            return f"dataset has {n} samples; this run's has {known['n_samples']}"
        if fp is not None and known.get("fingerprint") not in (None, fp):
            return f"dataset fingerprint {fp!r} differs from this run's {known['fingerprint']!r}"
    for k in COUNT_KEYS:
        v = config.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            return f"config.{k} {v!r} is not a positive count"
    for k in FACT_KEYS:
        if facts.get(k) is not None and config.get(k) != facts[k]:
            return f"{k} {config.get(k)!r} differs from this run's {facts[k]!r}"
    vocab = config.get("vocab_size")
    if facts.get("vocab_size") is not None and vocab is not None and vocab != facts["vocab_size"]:
        return f"vocab_size {vocab!r} differs from this run's {facts['vocab_size']!r}"
    new = dict(facts)
    for k in FACT_KEYS + KEPT_KEYS:
        if new.get(k) is None and config.get(k) is not None:
            new[k] = config[k]
    if known is None:
        new["dataset"] = {"n_samples": n, "fingerprint": fp}
    elif known.get("fingerprint") is None and fp is not None:
        new["dataset"] = {**known, "fingerprint": fp}
    return new


def set_facts(core: BrokerCore, facts: dict, peer_id: str) -> None:
    if facts == core.facts:
        return
    core.facts = facts
    if not core.leases.known:
        core.leases.set_dataset(facts["dataset"]["n_samples"])
    core.ledger.set_meta(facts=facts)
    runinfo.update(core.run_dir, facts=facts)
    log.info("broker.run_facts", peer=peer_id, **facts)


def open_pipes(core: BrokerCore) -> tuple[list, list[int], list[int]] | None:
    """Bind a new consumer's data streams: one pipe each on the next free ports of the
    range (core.streams of them), or None (nothing left bound) if there are not enough.
    Returns (pipes, their I/O threads, ports).

    Ports rotate through the range rather than reusing the lowest: a consumer declared
    lost but still running reconnects to its old ports, and must not find someone
    else's batches there.
    """
    lo, hi = core.cfg.data_out_ports
    n = hi - lo + 1
    used = {port for c in core.peers.live("consumer") for port in c.ports}
    in_use = [t for c in core.peers.live("consumer") for t in c.pipe_threads]
    socks, threads, ports = [], [], []
    for i in range(n):
        if len(socks) == core.streams:
            break
        port = lo + (core.next_port - lo + i) % n
        if port in used:
            continue
        thread = pipe_thread(core.pipe_threads, in_use)
        sock = core.bind_pipe(port, thread)
        if sock is None:
            continue  # another process holds it
        socks.append(sock)
        threads.append(thread)
        ports.append(port)
        in_use.append(thread)
    if len(socks) < core.streams:
        core.discard_pipes(socks)
        return None
    core.next_port = lo + (ports[-1] + 1 - lo) % n
    return socks, threads, ports


def pipe_thread(threads: list[int], in_use: list[int]) -> int:
    """The I/O thread (an affinity mask) for a new data stream: of the broker's pipe
    threads, the one fewest open streams use. One thread per stream, chosen here: given the
    whole mask, libzmq counted each pipe's idle listener as load and put every connection
    on one thread (seen in bench/scaling.py with several I/O threads)."""
    return min(threads, key=in_use.count)


def _brief(config: dict) -> dict:
    """The hello config for the log line, or only its keys if it is large."""
    text = json.dumps(config, default=str)
    return config if len(text) <= 4000 else {"keys": sorted(config)[:64], "bytes": len(text)}


def dist_endpoint(addr) -> str | None:
    """rank 0's `config.dist_addr` ('host:port' or 'tcp://host:port') as tcp://host:port."""
    if not isinstance(addr, str) or not addr:
        return None
    return addr if addr.startswith("tcp://") else f"tcp://{addr}"
