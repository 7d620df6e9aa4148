"""The status map (`status_reply.status`, `dflash-status --json`) and the periodic
`broker.progress` line. Fields are listed in docs/LOGS.md ("status map").

Rich on purpose: `diagnosis.diagnose` says what limits throughput from this map alone
(idle consumers, a full queue, a lost peer, an idle GPU), so per-peer figures are the ones
its heartbeats report plus what the broker measures itself. The heartbeat figures every
row shows are also copied to the row's top level (null when a peer does not report
them), so scripts read one fixed shape.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from dflash.protocol.messages import PROTOCOL_VERSION
from dflash.runtime.logs import get_logger

from .config import MAX_CREDIT
from .diagnosis import HOLD_TICKS, Steady, diagnose, result
from .handshake import job_lost_reason
from .phase import Phase

if TYPE_CHECKING:  # the core calls these with itself; imported for the annotations only
    from .core import BrokerCore

log = get_logger()

_SCALAR = (bool, int, float, type(None))
GPU_KEYS = ("gpu_mem_used", "gpu_mem_total", "gpu_util")
QUIET = ("balanced", "starting", "stopping", "finishing")  # diagnoses logged at info, not warning
ROW_KEYS = {"producer": ("q_pre", "oom_backoff", *GPU_KEYS),
            "consumer": ("step", "loss", "acc", "streak", "oom_backoff", *GPU_KEYS)}


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def sanitize_stats(stats: dict) -> dict:
    """Keep what a status map can carry: <=48 short keys of scalars, short strings, or
    small flat lists/maps of numbers. A peer cannot make the reply huge or nested."""
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


def samples(core: BrokerCore) -> dict:
    c = core.ledger.counts
    n = core.leases.n_samples
    total = None if n is None else n * core.cfg.epochs
    return {
        "total": total, "pending": core.leases.pending() if n is not None else None,
        "leased": c["leased"], "produced": c["produced"], "delivered": c["delivered"],
        "trained": c["trained"], "committed": c["committed"], "skipped": c["skipped"],
        "quarantined": c["quarantined"],  # set aside as poison (quarantine.py): never trained
        # committed by the runs a resumed run continues: never leased here
        "inherited": c.get("inherited", 0),
        "done": c["trained"] + c["committed"] + c["skipped"] + c["quarantined"] + c.get("inherited", 0),
        "epoch": core.leases.epoch, "epochs": core.cfg.epochs, "n_samples": n,
    }


def trained_figures(s: dict) -> dict:
    """What a person reads as progress, from `samples`: samples trained and committed over
    the whole resume chain (inherited ones are trained and committed), so they agree with
    `fraction` and with "every sample trained"; and the epoch training is in, by samples
    done (0-based), not the epoch leases come from: producers run ahead of training, by a
    whole epoch on a small dataset."""
    n, done = s["n_samples"], s["done"]
    epoch = min(s["epochs"] - 1, done // n) if n else s["epoch"]
    return {"trained": s["trained"] + s["committed"] + s["inherited"], "committed": s["committed"] + s["inherited"],
            "inherited": s["inherited"], "epoch": epoch}


def _peer_state(core: BrokerCore, p) -> str:
    reported = p.stats.get("state")
    if core.end is not None and p.id in core.end.told:
        return "stopping"
    if isinstance(reported, str):
        return reported
    if p.role == "producer":
        return "producing" if core.leases.open_leases(p.id) else "idle"
    if p.waiting_since is not None:
        return "waiting"  # has credit, queue empty: starved by producers
    return "training" if p.in_flight else "idle"


def peer_row(core: BrokerCore, p, now: float) -> dict:
    row = {
        "peer": p.id, "role": p.role, "instance": p.instance, "host": p.host, "pid": p.pid, "gpu": p.gpu,
        "state": _peer_state(core, p), "joined_at": _iso(p.joined_at),
        "connected_s": round(max(0.0, time.time() - p.joined_at), 3),
        "heartbeat_age_s": round(now - p.last_seen, 3),
        "stats": p.stats, "stats_at": _iso(p.stats_at),
        "batches_per_s": round(p.rate_in.rate(now), 3), "tokens_per_s": round(p.rate_tokens.rate(now), 1),
        "reported_tokens_per_s": _number(p.stats.get("tokens_per_s")),
    }
    row.update({k: _figure(p.stats.get(k)) for k in ROW_KEYS[p.role]})
    if p.role == "producer":
        leases = core.leases.open_leases(p.id)
        row.update(leases_open=len(leases), batches_in=p.batches_in, bytes_in=p.bytes_in,
                   samples_in=p.samples_in, stale=p.stale,
                   in_flight=sum(len(le.outstanding) for le in leases))  # leased samples not arrived yet
    else:
        row.update(rank=p.rank, credit=p.credit, in_flight=len(p.in_flight),
                   in_flight_bytes=sum(x.nbytes for x in p.in_flight.values()), delivered=p.delivered,
                   acked=p.acked, data_out=p.data_out, data_streams=p.data_streams,
                   waiting_s=None if p.waiting_since is None else round(now - p.waiting_since, 3),
                   wait_frac=round(p.wait_share.share(now), 3), eval=_eval(p.stats.get("eval")))
    return row


def _eval(v) -> dict | None:
    """A consumer's latest live evaluation (`--eval-every`, its heartbeat's `eval` map), or null."""
    return v if isinstance(v, dict) and v else None


def _number(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _figure(v):
    """A heartbeat figure as the row shows it: a number, a flag, or null."""
    return v if isinstance(v, (bool, int, float)) else None


def gone_row(p) -> dict:
    return {"peer": p.id, "role": p.role, "instance": p.instance, "host": p.host, "pid": p.pid, "gpu": p.gpu,
            "state": p.state, "at": _iso(p.gone_at), "ago_s": round(time.time() - p.gone_at, 1),
            "reason": p.gone_reason, "held": p.held, "last_stats": p.stats,
            "last_step": _number(p.stats.get("step")), "failure": p.failure}


def progress(core: BrokerCore, now: float) -> dict:
    """Where the run stands and when it should end, from the pace of the last minute."""
    s = samples(core)
    sps = core.rate_samples.rate(now)
    left = None if s["total"] is None else max(0, s["total"] - s["done"])
    eta = round(left / sps) if left is not None and sps > 0 else None
    if core.job_lost is not None:  # nothing more is trained in this run: no end to foresee
        eta = None
    return {
        **trained_figures(s), "epochs": s["epochs"],
        "epochs_done": round(s["done"] / s["n_samples"], 4) if s["n_samples"] else None,
        "fraction": round(s["done"] / s["total"], 4) if s["total"] else None, "done": s["done"],
        "total": s["total"], "samples_per_s": round(sps, 2), "eta_s": eta,
        "eta_at": _iso(time.time() + eta) if eta is not None else None,
    }


def build_status(core: BrokerCore) -> dict:
    now = time.monotonic()
    consumers = core.peers.live("consumer")
    # job_lost: the training job died with uncommitted work; new consumers are refused
    state = "stopping" if core.end is not None else "job_lost" if core.phase is Phase.JOB_LOST else "running"
    st = {
        "run_id": core.run_id,
        "protocol_version": PROTOCOL_VERSION,
        "broker": {
            "instance": core.cfg.instance, "host": core.hostname, "pid": os.getpid(), "state": state,
            "stop_reason": core.end.reason if core.end is not None else None,  # end_of_stream | shutdown
            "started_at": _iso(core.started_at), "uptime_s": round(now - core.started_mono, 3),
            "endpoints": core.endpoints, "run_dir": str(core.run_dir), "now": _iso(time.time()),
        },
        "config": {k: getattr(core.cfg, k) for k in ("epochs", "seed", "queue_bytes", "lease_size", "heartbeat_s",
                                                   "timeout_s", "consumers", "max_message_bytes")}
        | {"max_credit": MAX_CREDIT},
        "facts": core.facts,
        "progress": progress(core, now),
        "queue": {
            "batches": len(core.queue), "bytes": core.queue.bytes, "capacity_bytes": core.queue.capacity,
            "oldest_age_s": round(core.queue.oldest_age(now), 3), "reading": core.queue.has_room(),
            "full_frac": round(core.full_share.share(now), 3),
            "in_flight_batches": sum(len(c.in_flight) for c in consumers),
            "in_flight_bytes": sum(x.nbytes for c in consumers for x in c.in_flight.values()),
        },
        "samples": samples(core),
        "bad_batches": core.poison.as_dict(),
        "rates": {"batches_in_per_s": round(core.rate_in.rate(now), 3),
                  "batches_out_per_s": round(core.rate_out.rate(now), 3),
                  "batches_in": core.rate_in.total, "batches_out": core.rate_out.total},
        "leases": {"open": len(core.leases.open)},
        "ledger": {"path": str(core.ledger.path), "write_s": round(core.ledger.flush_seconds, 3)},
        "peers": [peer_row(core, p, now) for p in core.peers.live()],
        "job_lost": ({**asdict(core.job_lost), "text": job_lost_reason(core)} if state == "job_lost" else None),
        "gone": [gone_row(p) for p in core.peers.gone],
    }
    try:
        # hysteresis across ticks and asks: a new bottleneck holds for HOLD_TICKS progress ticks
        steady = core.__dict__.setdefault("steady_diagnosis", Steady(HOLD_TICKS * core.cfg.progress_s))
        st["diagnosis"] = steady.update(diagnose(st), now)
    except Exception as e:  # called from the loop's tick: a diagnosis bug must not end the run
        st["diagnosis"] = result("unknown", f"diagnosis failed: {type(e).__name__}: {e}")
    return st


def progress_fields(core: BrokerCore, now: float) -> dict:
    """The flat fields of one `broker.progress` line (a canonical periodic summary)."""
    s = samples(core)
    t = trained_figures(s)
    consumers = core.peers.live("consumer")
    return {
        "uptime_s": round(now - core.started_mono, 1), "queue_batches": len(core.queue),
        "queue_bytes": core.queue.bytes,
        "oldest_age_s": round(core.queue.oldest_age(now), 3), "in_flight": sum(len(c.in_flight) for c in consumers),
        "producers": len(core.peers.live("producer")), "consumers": len(consumers),
        "waiting_consumers": [c.id for c in consumers if c.waiting_since is not None],
        "samples_total": s["total"], "samples_trained": t["trained"], "samples_committed": t["committed"],
        "samples_inherited": t["inherited"], "samples_skipped": s["skipped"], "samples_quarantined": s["quarantined"],
        "epoch": t["epoch"],
        "batches_in_per_s": round(core.rate_in.rate(now), 3), "batches_out_per_s": round(core.rate_out.rate(now), 3),
    }


def log_progress(core: BrokerCore, now: float) -> None:
    """The `broker.progress` line, with the diagnosis; and `broker.diagnosis` when the
    diagnosis changes, so the logs say when and why throughput changed."""
    st = build_status(core)
    d, p = st["diagnosis"], st["progress"]
    fields = progress_fields(core, now)
    log.info("broker.progress", **fields, samples_per_s=p["samples_per_s"], eta_s=p["eta_s"], diagnosis=d["code"])
    sink = core.metric_sink  # --tensorboard
    if sink is not None:
        sink(int(fields["uptime_s"]), {**fields, "samples_per_s": p["samples_per_s"], "eta_s": p["eta_s"]})
    if d["code"] != core.last_diagnosis:
        core.last_diagnosis = d["code"]
        level = log.info if d["code"] in QUIET else log.warning
        level("broker.diagnosis", code=d["code"], text=d["text"], suggestion=d["suggestion"],
              limited_by=d["limited_by"])
