"""The core's part for peer sessions (PROTOCOL.md 4.1, 4.2): `hello` -> `welcome` or
`reject`, reconnects, consumers' data pipes and ranks, heartbeats and `failed`, who went
silent or stopped acking, and a session's end. A peer ID is spent only once every check passed.
"""

from __future__ import annotations

from dataclasses import asdict

from dflash.protocol.messages import CommitPoint, DatasetFacts, Failed, Heartbeat, Hello, RunConfig, Stop, Welcome
from dflash.runtime.logs import get_logger

from .actions import Joining, Outbox
from .config import MAX_CREDIT, BrokerConfig
from .facts import RunFacts
from .handshake import brief, dist_endpoint, malformed, pipe_thread, same_process, second_model
from .ledger import Ledger
from .liveness import TimeShare, WallClock
from .peers import ConsumerHeld, ConsumerSession, Failure, PeerTable, Pipes, ProducerHeld, ProducerSession, Session
from .phase import Lifecycle, Phase
from .replies import MAX_REASON, Replies, clip
from .resume import Parent
from .statements import ConsumerStatement, ProducerStatement

log = get_logger()

_SCALAR = (bool, int, float, type(None))


def sanitize_stats(stats: dict) -> dict:
    """Keep what a status map can carry (few short keys, flat values): a peer cannot make it huge or nested."""
    out = {}
    for k, v in list(stats.items())[:48]:
        if not isinstance(k, str) or len(k) > 64:
            continue
        if isinstance(v, _SCALAR):
            out[k] = v
        elif isinstance(v, str):
            out[k] = v[:200]
        elif isinstance(v, list) and len(v) <= 64 and all(isinstance(x, _SCALAR) for x in v):
            out[k] = v
        elif isinstance(v, dict) and len(v) <= 64 and all(
            isinstance(kk, str) and len(kk) <= 64 and isinstance(x, _SCALAR) for kk, x in v.items()
        ):
            out[k] = v
    return out


class Sessions:
    def __init__(self, cfg: BrokerConfig, run_id: str, data_in: str, *, advertise: str, streams: int,
                 producer_streams: int, pipe_threads: list[int], facts: RunFacts, ledger: Ledger,
                 life: Lifecycle, parent: Parent | None, replies: Replies, out: Outbox, wall: WallClock):
        """`streams` pipes per consumer, on the I/O threads of `pipe_threads` (affinity masks)."""
        self.cfg, self.run_id, self.data_in, self.advertise = cfg, run_id, data_in, advertise
        self.streams, self.producer_streams = streams, producer_streams
        self.pipe_threads = pipe_threads
        self.facts, self.ledger, self.life, self.parent = facts, ledger, life, parent
        self.replies, self.out, self.wall = replies, out, wall
        self.table = PeerTable()
        self.next_port = cfg.data_out_ports[0]
        self.dist: str | None = None  # rank 0's rendezvous endpoint
        self.lighthouse: str | None = None  # the elastic consumers' lighthouse, once the server started it
        self.peer_messages = 0  # control messages other than status asks, refused ones included

    def heard(self, identity: bytes, type_: object, now: float) -> Session | None:
        """A control message came from `identity`: any message of a live session counts as a heartbeat."""
        if type_ != "status":
            self.peer_messages += 1  # someone tried to take part (a run nobody tried is empty: broker_process)
        p = self.table.by_identity.get(identity)
        if p is not None:
            p.last_seen = now
        return p

    # ------------------------------------------------------------ hello

    def hello(self, identity: bytes, m: Hello, key: str | None, now: float) -> None:
        """`key`: the authorised Curve key's name this connection used (None without Curve)."""
        role, h = m.role, m.raw

        def refuse(code: str, reason: str, echo: dict = h) -> None:
            self.replies.refuse(identity, code, reason, echo, now)

        bad = malformed(m)
        if bad is not None:
            return refuse("bad_message", *bad)
        table = self.table
        same = table.by_identity.get(identity)
        if same is not None:
            if same.role == role and same.instance == m.instance:
                return self.welcome(same)  # the peer retried its hello: give the same answer
            return refuse("bad_message", f"this connection already joined as {same.id}")
        if len(table.by_id) >= self.cfg.max_peers:  # every session costs memory: a flood of hellos must not
            return refuse("full", f"{self.cfg.max_peers} live peers already (--max-peers)")
        other = table.instance_taken(role, m.instance)
        if other is not None and same_process(other, m, key):
            return self.reconnected(other, identity)
        if other is not None:
            return refuse("duplicate_instance", f"a live {role} is already named {m.instance!r} ({other.id} on "
                          f"{other.host}, pid {other.pid}); give this one another name (--instance)")
        said = ProducerStatement.read(m.config) if role == "producer" else ConsumerStatement.read(m.config)
        if isinstance(said, ConsumerStatement) and self.life.phase is Phase.JOB_LOST and not self.takes_over(said):
            return refuse("job_lost", self.life.job_lost.text(self.run_id))
        wrong_target = self.facts.target_mismatch(said, table.consumers())
        if wrong_target is not None:
            return refuse("config_mismatch", wrong_target)
        if isinstance(said, ConsumerStatement):
            return self.consumer_hello(identity, m, said, key, now)
        facts = self.facts.facts.with_producer(said)
        if isinstance(facts, str):
            return refuse("config_mismatch", facts)
        p = ProducerSession(id=table.next_id(role), said=said, **self.base(identity, m, key, now))
        table.add(p)
        self.facts.fix(facts, p.id)
        self.joined(p, m, key)

    def consumer_hello(self, identity: bytes, m: Hello, said: ConsumerStatement, key: str | None, now: float) -> None:
        """A consumer's hello past the common checks: one model per run, its rank, then its pipes."""
        table = self.table
        rival = None if self.cfg.consumers else second_model(said, table.consumers())
        if rival is not None:
            return self.replies.refuse(identity, "full", f"this broker arranges no data-parallel ranks (--consumers 0) "
                                       f"and consumer {rival.id} ({rival.instance} on {rival.host}) is training "
                                       "already: another consumer would train a separate model into the same run; "
                                       "start the broker with --consumers N to train N consumers as one model",
                                       m.raw, now)
        rank = None
        if self.cfg.consumers:
            rank = table.next_rank(self.cfg.consumers)
            if rank is None:
                return self.replies.refuse(identity, "full", f"all {self.cfg.consumers} ranks (--consumers) are held "
                                           "by live consumers", m.raw, now)
        ports, threads = self.pipe_plan()
        self.out.open_pipes(ports, threads, Joining(identity, m, key, rank, now))

    def pipes_bound(self, j: Joining, threads: tuple[int, ...], ports: list[int]) -> None:
        """The server bound `ports` for consumer hello `j`: too few and it is refused, else its session starts."""
        m, now = j.hello, j.now
        lo, hi = self.cfg.data_out_ports
        if j.identity in self.table.by_identity:  # its hello was answered already: nothing to bind for
            return self.out.close_pipes(ports)
        if len(ports) < self.streams:
            self.out.close_pipes(ports)
            return self.replies.refuse(j.identity, "full", f"not {self.streams} free data-out port(s) in {lo}-{hi} "
                                       f"(--data-out-ports; {self.streams} per consumer, --data-streams)", m.raw, now)
        self.next_port = lo + (ports[-1] + 1 - lo) % (hi - lo + 1)
        pipes = Pipes(list(threads), list(ports), [f"tcp://{self.advertise}:{port}" for port in ports])
        said = ConsumerStatement.read(m.config)
        p = ConsumerSession(id=self.table.next_id("consumer"), said=said, pipes=pipes, rank=j.rank,
                            wait_share=TimeShare(now), progress_at=now, **self.base(j.identity, m, j.key, now))
        self.table.add(p)
        if j.rank == 0:
            self.dist = dist_endpoint(said.dist_addr)
        self.joined(p, m, j.key)

    def base(self, identity: bytes, m: Hello, key: str | None, now: float) -> dict:
        """What a new session of either role starts with."""
        return dict(identity=identity, instance=m.instance, host=m.host, pid=m.pid, gpu=m.gpu,
                    joined_at=self.wall.at(now), last_seen=now, curve_key=key)

    def joined(self, p: Session, m: Hello, key: str | None) -> None:
        """Session `p` starts: recorded, logged (broker.peer_joined), welcomed."""
        self.ledger.peer_joined(p)
        streams = p.pipes.endpoints if isinstance(p, ConsumerSession) else []
        log.info("broker.peer_joined", **p.describe(), rank=p.rank if isinstance(p, ConsumerSession) else None,
                 data_out=streams[0] if streams else None, data_streams=streams or None, config=brief(m.config),
                 curve_key=key)
        self.welcome(p)
        end = self.life.end
        if end is not None:  # joined after end of stream (or during a shutdown): nothing left to do
            end.told.add(p.id)
            self.out.send(p.identity, Stop(end.reason))

    def takes_over(self, said: ConsumerStatement) -> bool:
        """An elastic consumer that announces lineages may join after the job died: its `lineage` message
        sends what only the dead weights held back to the lease pool."""
        return self.lighthouse is not None and said.lineages

    def reconnected(self, p: Session, identity: bytes) -> None:
        """Move session `p` to its new connection (same ID, leases, credit, pipes) and welcome it again."""
        old = p.identity
        self.table.move(p, identity)
        log.warning("broker.peer_reconnected", **p.describe(), old_identity=old.hex()[:64],
                    identity=identity.hex()[:64], hint="its control connection was closed and reopened (a network "
                    "reset, or a frame over the control limit)")
        self.welcome(p)
        end = self.life.end
        if end is not None and p.id in end.told:
            self.out.send(p.identity, Stop(end.reason))

    def welcome(self, p: Session) -> None:
        facts, start, parent_run, ranks = self.facts.facts, None, None, {}
        if self.parent is not None:  # consumers load this checkpoint, not a newer one (PROTOCOL.md 8)
            parent_run, start = self.parent.run_id, self.parent.resumed_from
        if self.ledger.last_commit is not None:  # a consumer joining later starts from this run's newest commit
            step, checkpoint = self.ledger.last_commit
            start = {"run": self.run_id, "step": step, "checkpoint": checkpoint}
        if isinstance(p, ConsumerSession):
            data = {"data_out": p.pipes.endpoints[0], "data_streams": list(p.pipes.endpoints)}
            if self.cfg.consumers:  # elastic (a lighthouse): world_size is the most at once
                ranks = {"rank": p.rank, "world_size": self.cfg.consumers, "dist": self.dist,
                         "lighthouse": self.lighthouse}
        else:
            # one endpoint per connection to open, so batches in spread over the I/O threads
            data = {"data_in": self.data_in, "data_streams": [self.data_in] * self.producer_streams}
        ds = facts.dataset
        run_config = RunConfig(
            self.cfg.epochs, self.cfg.seed, self.cfg.lease_size, self.cfg.max_message_bytes, MAX_CREDIT,
            target=facts.target, target_id=facts.target_id, layer_ids=facts.layer_ids, hidden_size=facts.hidden_size,
            vocab_size=facts.vocab_size, dataset=DatasetFacts(ds.n_samples, ds.fingerprint) if ds else None,
            parent_run=parent_run,
            resumed_from=CommitPoint(start["run"], start["step"], start["checkpoint"]) if start else None, **ranks)
        self.out.send(p.identity, Welcome(self.run_id, p.id, self.cfg.heartbeat_s, self.cfg.timeout_s,
                                          run_config=run_config, **data))

    def pipe_plan(self) -> tuple[list[int], list[int]]:
        """Free ports to try in order and the I/O thread of each pipe. Ports rotate rather than reuse the
        lowest: a consumer declared lost but running reconnects to its old ports and must not find
        someone else's batches there."""
        lo, hi = self.cfg.data_out_ports
        n = hi - lo + 1
        consumers = self.table.consumers()
        used = {port for c in consumers for port in c.pipes.ports}
        ports = [port for i in range(n) if (port := lo + (self.next_port - lo + i) % n) not in used]
        in_use, threads = [t for c in consumers for t in c.pipes.threads], []
        for _ in range(self.streams):
            threads.append(pipe_thread(self.pipe_threads, in_use))
            in_use.append(threads[-1])
        return ports, threads

    # ------------------------------------------------------------ what live sessions say

    def heartbeat(self, p: Session, m: Heartbeat, now: float) -> None:
        p.stats, p.stats_at = sanitize_stats(m.stats), self.wall.at(now)

    def failed(self, p: Session, m: Failed) -> Failure:
        """A peer stops on an error (PROTOCOL.md 4.2): kept for the status map and the diagnosis."""
        p.failure = Failure(clip(m.code, 64), clip(m.reason, MAX_REASON), clip(m.hint, MAX_REASON),
                            clip(m.source, 256), clip(m.batch_id, 64), clip(m.fault, 64))
        return p.failure

    # ------------------------------------------------------------ who must go

    def silent(self, now: float) -> list[tuple[Session, str]]:
        """Sessions with no message for longer than --timeout-s, and why they are lost."""
        t = self.cfg.timeout_s
        return [(p, f"silent for {now - p.last_seen:.1f}s (timeout {t}s)") for p in self.table.live()
                if now - p.last_seen > t]

    def overdue_acks(self, now: float) -> list[tuple[ConsumerSession, str]]:
        """Consumers holding batches that acked none within their deadline: alive but hung, they would
        hold their batches forever and block end of stream."""
        out = []
        for c in self.table.consumers():
            if not c.in_flight:
                continue
            deadline = self.cfg.ack_deadline(c.slowest_ack_gap)
            waited = now - c.progress_at
            if waited > deadline:
                log.warning("broker.ack_overdue", peer=c.id, peer_instance=c.instance, in_flight=len(c.in_flight),
                            batch_ids=list(c.in_flight)[:16], waited_s=round(waited, 1),
                            deadline_s=round(deadline, 1), acked=c.acked, last_step=c.stats.get("step"),
                            state=c.stats.get("state"))
                out.append((c, f"no ack for {waited:.1f}s while holding {len(c.in_flight)} delivered batches "
                               f"(ack deadline {deadline:.0f}s, --ack-timeout-s)"))
        return out

    # ------------------------------------------------------------ the end of a session

    def remove(self, p: Session, state: str, reason: str, held: ProducerHeld | ConsumerHeld, now: float) -> None:
        """End session `p` (state 'lost' or 'left'), what it `held` given back: its pipes close."""
        if isinstance(p, ConsumerSession):
            self.out.close_pipes(p.pipes.ports)
        p.held = held
        self.table.remove(p, state, reason, self.wall.at(now))

    def log_gone(self, p: Session, silent_s: float) -> None:
        """Record and log a session `remove` ended (broker.peer_lost, broker.peer_left)."""
        self.ledger.peer_gone(p.id, p.state, p.gone_reason)
        fields = dict(**p.describe(), reason=p.gone_reason, silent_s=silent_s, held=asdict(p.held), last_stats=p.stats)
        if p.state == "lost":
            log.warning("broker.peer_lost", **fields)
        else:
            log.info("broker.peer_left", **fields)

    def close_pipes(self) -> None:
        """The broker stops: every live consumer's pipes close."""
        for c in self.table.consumers():
            self.out.close_pipes(c.pipes.ports)
