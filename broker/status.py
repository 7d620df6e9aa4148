"""The status map (`status_reply.status`, `dflash-status --json`), the periodic `broker.progress`
line, and the broker's heartbeat figures (fields in docs/LOGS.md). `StatusMap` reads every other
part and changes none; the map is rich so `diagnosis.diagnose` can work from it alone.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from dflash.protocol.fields import PROTOCOL_VERSION
from dflash.runtime.logs import get_logger

from .commits import Commits
from .config import MAX_CREDIT, BrokerConfig
from .delivery import Delivery
from .diagnosis import HOLD_TICKS, Steady, diagnose, result
from .facts import RunFacts
from .ledger import Ledger
from .liveness import WallClock
from .peers import ConsumerSession, ProducerSession, Session
from .phase import Lifecycle, Phase
from .quarantine import Poison
from .sessions import Sessions
from .work import Work

log = get_logger()

GPU_KEYS = ("gpu_mem_used", "gpu_mem_total", "gpu_util")
QUIET = ("balanced", "starting", "stopping", "finishing")  # diagnoses logged at info, not warning
ROW_KEYS = {"producer": ("q_pre", "oom_backoff", *GPU_KEYS),
            "consumer": ("step", "loss", "acc", "streak", "oom_backoff", *GPU_KEYS)}


class StatusMap:
    def __init__(self, cfg: BrokerConfig, run_id: str, run_dir: Path, hostname: str, endpoints: dict, *,
                 sessions: Sessions, work: Work, delivery: Delivery, commits: Commits, facts: RunFacts,
                 life: Lifecycle, ledger: Ledger, poison: Poison, wall: WallClock, now: float):
        self.cfg, self.run_id, self.run_dir, self.hostname, self.endpoints = cfg, run_id, run_dir, hostname, endpoints
        self.sessions, self.work, self.delivery, self.commits = sessions, work, delivery, commits
        self.facts, self.life, self.ledger, self.poison, self.wall = facts, life, ledger, poison, wall
        self.started_mono = now
        self.steady = Steady(HOLD_TICKS * cfg.progress_s)
        self.last_diagnosis: str | None = None  # logged as broker.diagnosis when it changes
        self.metric_sink = None  # --tensorboard / --wandb (runtime/sinks.py)
        self.budget = None  # --time-budget's plan (budget.py), set by the core

    def samples(self) -> dict:
        c = self.ledger.counts
        pool = self.work.pool
        n = pool.n_samples
        total = None if n is None else n * self.cfg.epochs
        return {
            "total": total, "pending": pool.pending() if n is not None else None,
            "leased": c["leased"], "produced": c["produced"], "delivered": c["delivered"],
            "trained": c["trained"], "committed": c["committed"], "skipped": c["skipped"],
            "quarantined": c["quarantined"],  # set aside as poison (quarantine.py): never trained
            "inherited": c.get("inherited", 0),
            "done": c["trained"] + c["committed"] + c["skipped"] + c["quarantined"] + c.get("inherited", 0),
            "epoch": pool.epoch, "epochs": self.cfg.epochs, "n_samples": n,
        }

    def planned_samples(self) -> int | None:
        """What the run plans to train: --time-budget's plan once made, else epochs x samples."""
        total = self.samples()["total"]
        planned = self.budget.planned if self.budget is not None else None
        return total if planned is None or total is None else min(total, planned)

    def progress(self, now: float) -> dict:
        """Where the run stands and when it should end; the ETA is null while stalled, never a guess."""
        s = self.samples()
        sps = self.commits.rate_samples.rate(now)
        target = self.planned_samples()
        left = None if target is None else max(0, target - s["done"])
        eta = round(left / sps) if left is not None and sps > 0 else None
        if self.life.job_lost is not None:  # nothing more is trained in this run: no end to foresee
            eta = None
        return {
            **trained_figures(s), "epochs": s["epochs"],
            "epochs_done": round(s["done"] / s["n_samples"], 4) if s["n_samples"] else None,
            "fraction": round(s["done"] / s["total"], 4) if s["total"] else None, "done": s["done"],
            "total": s["total"], "samples_per_s": round(sps, 2), "eta_s": eta,
            "eta_at": _iso(self.wall.at(now) + eta) if eta is not None else None,
            "planned": target,
            "budget": self.budget.as_dict(now) if self.budget is not None else None,
        }

    def _peer_state(self, p: Session) -> str:
        reported = p.stats.get("state")
        end = self.life.end
        if end is not None and p.id in end.told:
            return "stopping"
        if isinstance(reported, str):
            return reported
        if isinstance(p, ProducerSession):
            return "producing" if self.work.pool.open_leases(p.id) else "idle"
        if p.waiting_since is not None:
            return "waiting"  # has credit, queue empty: starved by producers
        return "training" if p.in_flight else "idle"

    def peer_row(self, p: Session, now: float) -> dict:
        row = {
            "peer": p.id, "role": p.role, "instance": p.instance, "host": p.host, "pid": p.pid, "gpu": p.gpu,
            "state": self._peer_state(p), "joined_at": _iso(p.joined_at),
            "connected_s": round(max(0.0, self.wall.at(now) - p.joined_at), 3),
            "heartbeat_age_s": round(now - p.last_seen, 3),
            "stats": p.stats, "stats_at": _iso(p.stats_at),
            "batches_per_s": round(p.rate_in.rate(now), 3), "tokens_per_s": round(p.rate_tokens.rate(now), 1),
            "reported_tokens_per_s": _number(p.stats.get("tokens_per_s")),
        }
        row.update({k: _figure(p.stats.get(k)) for k in ROW_KEYS[p.role]})
        if isinstance(p, ProducerSession):
            leases = self.work.pool.open_leases(p.id)
            row.update(leases_open=len(leases), batches_in=p.batches_in, bytes_in=p.bytes_in,
                       samples_in=p.samples_in, stale=p.stale,
                       in_flight=sum(len(le.outstanding) for le in leases))  # leased samples not arrived yet
        elif isinstance(p, ConsumerSession):
            row.update(rank=p.rank, credit=p.credit, in_flight=len(p.in_flight),
                       in_flight_bytes=sum(x.nbytes for x in p.in_flight.values()), delivered=p.delivered,
                       acked=p.acked, data_out=p.pipes.endpoints[0], data_streams=list(p.pipes.endpoints),
                       waiting_s=None if p.waiting_since is None else round(now - p.waiting_since, 3),
                       wait_frac=round(p.wait_share.share(now), 3), eval=_eval(p.stats.get("eval")))
        return row

    def gone_row(self, p: Session, now: float) -> dict:
        return {"peer": p.id, "role": p.role, "instance": p.instance, "host": p.host, "pid": p.pid, "gpu": p.gpu,
                "state": p.state, "at": _iso(p.gone_at), "ago_s": round(self.wall.at(now) - p.gone_at, 1),
                "reason": p.gone_reason, "held": asdict(p.held) if p.held is not None else {},
                "last_stats": p.stats, "last_step": _number(p.stats.get("step")),
                "failure": p.failure.fields() if p.failure is not None else None}

    def build(self, now: float) -> dict:
        life, queue, consumers = self.life, self.delivery.queue, self.sessions.table.consumers()
        state = "stopping" if life.end is not None else "job_lost" if life.phase is Phase.JOB_LOST else "running"
        in_flight, in_flight_bytes = self.delivery.in_flight(consumers)
        rates = self.delivery
        st = {
            "run_id": self.run_id,
            "protocol_version": PROTOCOL_VERSION,
            "broker": {
                "instance": self.cfg.instance, "host": self.hostname, "pid": os.getpid(), "state": state,
                "stop_reason": life.end.reason if life.end is not None else None,  # end_of_stream | shutdown
                "started_at": _iso(self.wall.at(self.started_mono)), "uptime_s": round(now - self.started_mono, 3),
                "endpoints": self.endpoints, "run_dir": str(self.run_dir), "now": _iso(self.wall.at(now)),
            },
            "config": {k: getattr(self.cfg, k) for k in ("epochs", "seed", "queue_bytes", "lease_size",
                                                         "heartbeat_s", "timeout_s", "consumers",
                                                         "max_message_bytes")}
            | {"max_credit": MAX_CREDIT},
            "facts": self.facts.facts.as_dict(),
            "progress": self.progress(now),
            "queue": {
                "batches": len(queue), "bytes": queue.bytes, "capacity_bytes": queue.capacity,
                "oldest_age_s": round(queue.oldest_age(now), 3), "reading": queue.has_room(),
                "full_frac": round(rates.full_share.share(now), 3),
                "in_flight_batches": in_flight, "in_flight_bytes": in_flight_bytes,
            },
            "samples": self.samples(),
            "bad_batches": self.poison.as_dict(),
            "rates": {"batches_in_per_s": round(rates.rate_in.rate(now), 3),
                      "batches_out_per_s": round(rates.rate_out.rate(now), 3),
                      "batches_in": rates.rate_in.total, "batches_out": rates.rate_out.total},
            "leases": {"open": len(self.work.pool.open)},
            "ledger": {"path": str(self.ledger.path), "write_s": round(self.ledger.flush_seconds, 3)},
            "peers": [self.peer_row(p, now) for p in self.sessions.table.live()],
            "job_lost": ({**asdict(life.job_lost), "text": life.job_lost.text(self.run_id)}
                         if state == "job_lost" else None),
            "gone": [self.gone_row(p, now) for p in self.sessions.table.gone],
        }
        try:
            st["diagnosis"] = self.steady.update(diagnose(st), now)
        except Exception as e:  # called from the loop's tick: a diagnosis bug must not end the run
            st["diagnosis"] = result("unknown", f"diagnosis failed: {type(e).__name__}: {e}")
        return st

    def progress_fields(self, now: float) -> dict:
        """The flat fields of one `broker.progress` line (a canonical periodic summary)."""
        s = self.samples()
        t = trained_figures(s)
        queue, consumers = self.delivery.queue, self.sessions.table.consumers()
        return {
            "uptime_s": round(now - self.started_mono, 1), "queue_batches": len(queue),
            "queue_bytes": queue.bytes,
            "oldest_age_s": round(queue.oldest_age(now), 3), "in_flight": sum(len(c.in_flight) for c in consumers),
            "producers": len(self.sessions.table.producers()), "consumers": len(consumers),
            "waiting_consumers": [c.id for c in consumers if c.waiting_since is not None],
            "samples_total": s["total"], "samples_trained": t["trained"], "samples_committed": t["committed"],
            "samples_inherited": t["inherited"], "samples_skipped": s["skipped"],
            "samples_quarantined": s["quarantined"], "epoch": t["epoch"],
            "batches_in_per_s": round(self.delivery.rate_in.rate(now), 3),
            "batches_out_per_s": round(self.delivery.rate_out.rate(now), 3),
        }

    def log_progress(self, now: float) -> None:
        """The `broker.progress` line, and `broker.diagnosis` when the diagnosis changes."""
        st = self.build(now)
        d, p = st["diagnosis"], st["progress"]
        fields = self.progress_fields(now)
        log.info("broker.progress", **fields, samples_per_s=p["samples_per_s"], eta_s=p["eta_s"], diagnosis=d["code"])
        sink = self.metric_sink  # --tensorboard
        if sink is not None:
            sink(int(fields["uptime_s"]), {**fields, "samples_per_s": p["samples_per_s"], "eta_s": p["eta_s"]})
        if d["code"] != self.last_diagnosis:
            self.last_diagnosis = d["code"]
            level = log.info if d["code"] in QUIET else log.warning
            level("broker.diagnosis", code=d["code"], text=d["text"], suggestion=d["suggestion"],
                  limited_by=d["limited_by"])

    def heartbeat_stats(self) -> dict:
        """What the broker's heartbeat tells every peer (PROTOCOL.md 4.2)."""
        queue, sessions = self.delivery.queue, self.sessions.table
        stats = {
            "queue_batches": len(queue),
            "queue_bytes": queue.bytes,
            "q_pre": {p.id: p.stats.get("q_pre") for p in sessions.producers()},
            "in_flight": {c.id: len(c.in_flight) for c in sessions.consumers()},
            "max_credit": MAX_CREDIT,
            # a consumer that restarts from a checkpoint takes this one, newer than its welcome's
            "last_commit": self.commits.last_commit(),
        }
        # run progress only the broker knows; quarantined samples count as skipped (never trained)
        s = self.samples()
        stats.update(samples_total=s["total"], samples_done=s["done"],
                     samples_skipped=s["skipped"] + s["quarantined"], n_samples=s["n_samples"], epoch=s["epoch"],
                     epochs=s["epochs"])
        # a consumer that joined before any producer waits here for the target layers
        stats["run_facts"] = self.facts.facts.heartbeat()
        return stats


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def trained_figures(s: dict) -> dict:
    """Progress as a person reads it: trained and committed over the whole resume chain, and the epoch
    training is in by samples done (producers run ahead of it)."""
    n, done = s["n_samples"], s["done"]
    epoch = min(s["epochs"] - 1, done // n) if n else s["epoch"]
    return {"trained": s["trained"] + s["committed"] + s["inherited"], "committed": s["committed"] + s["inherited"],
            "inherited": s["inherited"], "epoch": epoch}


def _eval(v) -> dict | None:
    """A consumer's latest live evaluation (`--eval-every`, its heartbeat's `eval` map), or null."""
    return v if isinstance(v, dict) and v else None


def _number(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _figure(v):
    """A heartbeat figure as the row shows it: a number, a flag, or null."""
    return v if isinstance(v, (bool, int, float)) else None
