"""What limits the run's throughput now, in one line, and what to do about it.

`diagnose(status)` is a pure function of the status map (docs/STATUS.md); checks run most urgent
first and the first that fires wins, ending with the balance between targets and drafters. A side
waiting a fraction w of the time could go 1/(1-w) times faster; the suggestion moves whole GPUs to
maximise min(targets' supply, drafters' demand).
"""

from __future__ import annotations

IDLE_UTIL = 5.0  # percent: a GPU below this does no real work
RECENT_LOSS_S = 300.0  # an unreplaced loss older than this is history, not news
WAITS = 0.25  # fraction of the window a side waited before we call it the limit
MAX_WAIT = 0.95  # caps a capacity estimate at 20x the measured rate
MIN_GAIN = 1.10  # suggest moving GPUs only for an estimated gain of 10% or more
GROWS = 1.10  # targets making this much more than drafters train: the queue is filling up

WORD = {"producer": "target", "consumer": "drafter"}
SIDE = {"producer": "targets", "consumer": "drafters"}


def diagnose(st: dict) -> dict:
    """{code, text, suggestion, limited_by} for a status map. Never raises on missing keys."""
    for check in (_stopping, _job_lost, _remake_waits, _failed, _lost, _missing, _oom, _idle, _balance):
        d = check(st)
        if d is not None:
            return d
    raise AssertionError("_balance always answers")


# A new bottleneck must hold this long (HOLD_TICKS --progress-s ticks) before it replaces the one
# reported, or balance codes flap; phases and alarms are said at once.
HOLD_TICKS = 3
HOLD_S = 30.0
HELD = frozenset({"balanced", "drafters_starved", "lease_starved", "targets_backed_up", "queue_growing", "gpu_idle"})


class Steady:
    """The diagnosis with hysteresis: a HELD code replaces the report after `hold_s` (the old one
    stands meanwhile, with `pending`), so a report outlives its situation by at most `hold_s`."""

    def __init__(self, hold_s: float = HOLD_S):
        self.hold_s = hold_s
        self.reported: dict | None = None
        # since when the reported code is no longer diagnosed (timed per new code, codes taking turns
        # would reset it and a stale report would stand)
        self.absent_since: float | None = None

    def update(self, d: dict, now: float) -> dict:
        if (self.reported is None or d["code"] == self.reported["code"] or d["code"] not in HELD
                or self.reported["code"] not in HELD):
            self.reported, self.absent_since = d, None
            return d
        if self.absent_since is None:
            self.absent_since = now
        held = now - self.absent_since
        if held >= self.hold_s:
            self.reported, self.absent_since = d, None
            return d
        return {**self.reported, "pending": {"code": d["code"], "for_s": round(held, 1)}}


def result(code: str, text: str, suggestion: str | None = None, limited_by: str | None = None) -> dict:
    return {"code": code, "text": text, "suggestion": suggestion, "limited_by": limited_by}


# ---------------------------------------------------------------- the checks


def _stopping(st: dict) -> dict | None:
    if (st.get("broker") or {}).get("state") != "stopping":
        return None
    n = len(st.get("peers") or [])
    why = "shutdown (a signal): waiting for the consumers' last commit" if (
        st["broker"].get("stop_reason") == "shutdown") else "end of stream"
    return result("stopping", f"{why}: every peer was told to stop; {n} still to leave")


def _job_lost(st: dict) -> dict | None:
    """The training job died with uncommitted work: only a resume helps, not a restart."""
    lost = st.get("job_lost")
    if not isinstance(lost, dict) or (st.get("broker") or {}).get("state") == "stopping":
        return None
    run = st.get("run_id", "<run>")
    return result("job_lost", f"the training job is lost: {lost.get('text') or lost.get('reason')}",
                  f"new consumers are refused; stop the broker (SIGTERM: it drains and exits 0), then "
                  f"dflash-broker --resume {run} and start the producers and consumers again", "drafters")


def _remake_waits(st: dict) -> dict | None:
    """Quarantined batches' samples wait to be remade and no target is connected to make them."""
    s, bad = st.get("samples") or {}, (st.get("bad_batches") or {}).get("quarantined") or {}
    remade = sum(_num(row.get("remade"), 0) for row in bad.values() if isinstance(row, dict))
    pending = int(_num(s.get("pending"), 0))
    if _live(st, "producer") or not remade or pending <= 0:
        return None
    ctl = ((st.get("broker") or {}).get("endpoints") or {}).get("control", "<broker>")
    return result("remake_waits", f"start a producer: {pending} samples wait to be remade (their batch was "
                  "quarantined) and no target is connected", f"start dflash-produce --broker {ctl}", "targets")


def _failed(st: dict) -> dict | None:
    """A peer that stopped on an error and said why, not replaced: its cause and fix. Said while
    recent, or while its role has no live peer."""
    peers = st.get("peers") or []
    failed = [g for g in st.get("gone") or [] if isinstance(g.get("failure"), dict)
              and (_num(g.get("ago_s"), 0.0) <= RECENT_LOSS_S or not _live(st, g.get("role")))]
    failed = _not_replaced(failed, peers)
    if not failed:
        return None
    g = failed[-1]
    f, role = g["failure"], g.get("role")
    what = {"bad_row": "a bad dataset row", "bad_batch": "a batch that does not fit the run"}.get(f.get("code"),
                                                                                               "an error")
    text = f"{WORD.get(role, role)} {_name(g)} stopped {_dur(g.get('ago_s'))} ago on {what}: {f.get('reason')}"
    if f.get("source") and str(f["source"]) not in str(f.get("reason")):
        text += f" (at {f['source']})"
    if len(failed) > 1:
        text = f"{len(failed)} peers stopped on errors; latest: {text}"
    left = len(_live(st, role))
    carry = f"{left} {SIDE.get(role, role)} carry on" if left else f"no {WORD.get(role, role)} is left: the run waits"
    fix = f.get("hint") or f"read its last lines (dflash-logs --instance {g.get('instance')} --level error), restart it"
    return result("peer_failed", text, f"{fix} ({carry})", SIDE.get(role))


def _lost(st: dict) -> dict | None:
    lost = [g for g in st.get("gone") or [] if g.get("state") == "lost" and _num(g.get("ago_s"), 0.0) <= RECENT_LOSS_S
            and not isinstance(g.get("failure"), dict)]
    lost = _not_replaced(lost, st.get("peers") or [])
    if not lost:
        return None
    g = lost[-1]  # the gone list is oldest first
    role, held = g.get("role"), g.get("held") or {}
    text = f"{WORD.get(role, role)} {_name(g)} lost {_dur(g.get('ago_s'))} ago: {g.get('reason')}"
    if role == "consumer":
        text += f"; last step {g.get('last_step', '?')}; its {held.get('in_flight', 0)} unacked batches were requeued"
    else:
        text += f"; its {held.get('samples_returned', 0)} unfinished samples went back to the pool"
    if len(lost) > 1:
        text = f"{len(lost)} peers lost in the last {RECENT_LOSS_S / 60:.0f} min; latest: {text}"
    left = len(_live(st, role))
    carry = f"{left} {SIDE.get(role, role)} carry on" if left else f"no {WORD.get(role, role)} is left"
    return result("peer_lost", text, f"read its last lines (dflash-logs --instance {g.get('instance')} "
                  f"--level warning --level error) and restart it; {carry}", SIDE.get(role))


def _not_replaced(lost: list[dict], peers: list[dict]) -> list[dict]:
    """Losses no live peer made up for (same role and name, or each newcomer since for one loss)."""
    newcomers = {role: sorted(_num(p.get("connected_s"), float("inf")) for p in peers if p.get("role") == role)
                 for role in {g.get("role") for g in lost}}
    names = {(p.get("role"), p.get("instance")) for p in peers}
    left = []
    for g in sorted(lost, key=lambda g: _num(g.get("ago_s"), 0.0)):  # latest loss first
        if (g.get("role"), g.get("instance")) in names:
            continue
        ages = newcomers.get(g.get("role")) or []
        if ages and ages[0] <= _num(g.get("ago_s"), 0.0):
            ages.pop(0)
            continue
        left.append(g)
    return sorted(left, key=lambda g: -_num(g.get("ago_s"), 0.0))  # oldest first, as the gone list


def _missing(st: dict) -> dict | None:
    prod, cons = _live(st, "producer"), _live(st, "consumer")
    ctl = ((st.get("broker") or {}).get("endpoints") or {}).get("control", "<broker>")
    q, s = st.get("queue") or {}, st.get("samples") or {}
    if not prod and not cons:
        return result("no_peers", "no targets or drafters connected", f"start dflash-produce and dflash-consume "
                      f"with --broker {ctl}")
    if not cons:
        return result("no_drafters", f"no drafter connected: {q.get('batches', 0)} batches wait in the queue",
                      f"start dflash-consume --broker {ctl}", "drafters")
    if not prod:
        if not s.get("pending") and not s.get("leased") and s.get("total") is not None:
            return result("finishing", f"every sample is produced; drafters train the last "
                          f"{q.get('batches', 0) + q.get('in_flight_batches', 0)} batches")
        return result("no_targets", f"no target connected: drafters get nothing new ({q.get('batches', 0)} "
                      "batches left in the queue)", f"start dflash-produce --broker {ctl}", "targets")
    return None


def _oom(st: dict) -> dict | None:
    hit = [p for p in st.get("peers") or [] if p.get("oom_backoff") is True]
    if not hit:
        return None
    p = hit[0]
    ooms = (p.get("stats") or {}).get("ooms")
    now = "sends smaller batches" if p["role"] == "producer" else "splits its steps into micro-batches"
    text = (f"{WORD.get(p['role'])} {_name(p)} is in OOM backoff: it ran out of GPU memory"
            f"{f' ({ooms} times)' if ooms else ''} and now {now}{_mem(p)}")
    if len(hit) > 1:
        text += f"; {len(hit) - 1} more peers in backoff"
    budget = "--token-budget / --max-batch-size" if p["role"] == "producer" else "the targets' --token-budget"
    return result("oom_backoff", text, f"restart it with a smaller {budget} or free memory on its GPU",
                  SIDE.get(p["role"]))


def _idle(st: dict) -> dict | None:
    q = st.get("queue") or {}
    idle = [p for p in st.get("peers") or [] if _idle_with_work(p, q)]
    if not idle:
        return None
    role = idle[0]["role"]
    same = [p for p in idle if p["role"] == role]
    what = ", ".join(f"{_name(p)} {_util(p)}" for p in same)
    if role == "consumer":
        why = (f"while {q.get('batches', 0)} batches wait in the queue" if q.get("batches")
               else "while holding unacked batches")
        hint = "a memory limit, a stuck data-parallel peer, or an error"
    else:
        why, hint = "while the queue has room", "a stuck forward pass or an error"
    text = f"{len(same)} of {len(_live(st, role))} {WORD[role]} GPUs idle ({what}) {why}"
    return result("gpu_idle", text, f"check its log for {hint} (dflash-logs --instance "
                  f"{same[0].get('instance')} --level warning --level error)", SIDE[role])


def _idle_with_work(p: dict, q: dict) -> bool:
    """Idle although work is there for it (waiting on the other side is the balance's business)."""
    util = p.get("gpu_util")
    if p.get("role") == "consumer":
        if p.get("waiting_s") is not None or p.get("state") == "stopping":
            return False
        has_work = bool(q.get("batches")) or bool(p.get("in_flight"))
        no_credit = not p.get("credit") and not p.get("in_flight") and bool(q.get("batches"))
        return has_work and (no_credit or (isinstance(util, (int, float)) and util < IDLE_UTIL))
    return (p.get("state") == "producing" and q.get("reading", True) is True
            and isinstance(util, (int, float)) and util < IDLE_UTIL)


def _balance(st: dict) -> dict:
    d = _balance_of(st)
    shared = _shared_gpus(st)
    if shared and d["code"] != "starting":
        # sides sharing a GPU take turns, so their rates and waits are shares of it: moving GPUs misreads them
        where = ", ".join(shared[:3]) + (f" and {len(shared) - 3} more" if len(shared) > 3 else "")
        d = {**d, "suggestion": (f"targets and drafters share GPU {where}: they take turns on it, so their rates "
                                 "and waits are shares of one GPU, not what either side could do; give one side "
                                 "a GPU of its own (e.g. the consumer on another GPU) to run both at once")}
    return d


def _shared_gpus(st: dict) -> list[str]:
    """'host:gpu' of every GPU that a live producer and a live consumer both name."""
    def gpus(role: str) -> set[tuple[str, int]]:
        return {(str(p.get("host")), p["gpu"]) for p in _live(st, role)
                if isinstance(p.get("gpu"), int) and not isinstance(p.get("gpu"), bool)}

    return [f"{h}:{g}" for h, g in sorted(gpus("producer") & gpus("consumer"))]


def _balance_of(st: dict) -> dict:
    prod, cons = _live(st, "producer"), _live(st, "consumer")
    q, r = st.get("queue") or {}, st.get("rates") or {}
    if not r.get("batches_in"):
        return result("starting", "no batch produced yet: targets are loading or tokenising", None, "targets")
    full = _num(q.get("full_frac"), 0.0 if q.get("reading", True) else 1.0)
    waits = [_wait(c) for c in cons]
    wait = sum(waits) / len(waits)
    supply = sum(_num(p.get("tokens_per_s"), 0.0) for p in prod)
    trained = sum(_num(c.get("tokens_per_s"), 0.0) for c in cons)
    p_cap = sum(_capacity(p.get("tokens_per_s"), full) for p in prod) / len(prod)
    c_cap = sum(_capacity(c.get("tokens_per_s"), w) for c, w in zip(cons, waits)) / len(cons)
    if wait >= WAITS and wait > full:
        starved = _lease_starved(st, prod)
        if starved is not None:
            return starved
        waiting = sum(1 for c in cons if c.get("waiting_s") is not None)
        text = (f"targets limit throughput: drafters starved, queue {q.get('batches', 0)} batches, "
                f"{waiting} of {len(cons)} drafters waiting now ({wait:.0%} of the last 10 s); "
                f"targets make {_tok(supply)}")
        return result("drafters_starved", text, _suggest(len(prod), p_cap, len(cons), c_cap, "targets", _gpus(st)), "targets")
    # full_frac is the last 10 s: a queue emptied since is not backing targets up
    if q.get("reading") is False or (full >= WAITS and q.get("batches")):
        text = (f"drafters limit throughput: targets backed up, queue full ({q.get('batches', 0)} batches, "
                f"oldest {_dur(q.get('oldest_age_s'))}), targets blocked on send {full:.0%} of the last 10 s, "
                f"drafters busy training {_tok(trained)}{_straggler(cons)}")
        return result("targets_backed_up", text, _suggest(len(prod), p_cap, len(cons), c_cap, "drafters", _gpus(st)),
                      "drafters")
    if q.get("batches") and supply > GROWS * trained:
        text = (f"drafters limit throughput: queue growing ({q.get('batches')} batches, {_bytes(q.get('bytes'))} of "
                f"{_bytes(q.get('capacity_bytes'))}, oldest {_dur(q.get('oldest_age_s'))}), targets make "
                f"{_tok(supply)}, drafters train {_tok(trained)}{_straggler(cons)}; targets block once it is full")
        return result("queue_growing", text, _suggest(len(prod), p_cap, len(cons), c_cap, "drafters", _gpus(st)), "drafters")
    text = (f"balanced: targets make {_tok(supply)}, drafters train {_tok(trained)}, queue "
            f"{q.get('batches', 0)} batches, drafters waited {wait:.0%} and targets {full:.0%} of the last 10 s")
    return result("balanced", text, _suggest(len(prod), p_cap, len(cons), c_cap, None, _gpus(st)))


def _lease_starved(st: dict, prod: list[dict]) -> dict | None:
    """Drafters wait and idle targets find nothing left to lease: more targets would not help."""
    s = st.get("samples") or {}
    idle = [p for p in prod if p.get("leases_open") == 0]
    if not idle or s.get("pending") != 0 or not s.get("leased"):
        return None
    busy = [p for p in prod if p.get("leases_open")]
    size = (st.get("config") or {}).get("lease_size")
    text = (f"targets limit throughput through leases: {len(idle)} of {len(prod)} targets have no work "
            f"({', '.join(_name(p) for p in idle[:3])}): every sample left is leased, {s.get('leased')} of them to "
            f"{', '.join(_name(p) for p in busy[:3]) or 'targets that left'}")
    return result("lease_starved", text, f"no more targets or cores would help: this is the end of the run's "
                  f"samples, made by the targets that hold them; a smaller --lease-size (now {size}) spreads the "
                  "last ones over more targets", "targets")


# ---------------------------------------------------------------- the arithmetic


def best_move(n_targets: int, target_rate: float, n_drafters: int, drafter_rate: float) -> tuple[int, float, float]:
    """(k, rate now, rate after): k GPUs to move from targets to drafters (negative: back) maximising
    min(supply, demand), keeping one of each; ties go to the smaller move."""
    def rate(k: int) -> float:
        return min((n_targets - k) * target_rate, (n_drafters + k) * drafter_rate)

    k = max(range(-(n_drafters - 1), n_targets), key=lambda k: (round(rate(k), 6), -abs(k)))
    return k, rate(0), rate(k)


def _suggest(n_p: int, p_cap: float, n_c: int, c_cap: float, limit: str | None, gpus: bool = True) -> str | None:
    if not gpus:  # a CPU run: its processes share the host's cores, there is no GPU to move
        return {"targets": "targets limit it: on CPU, give the producers more cores (or GPUs)",
                "drafters": "drafters limit it: on CPU, give the consumers more cores (or GPUs)"}.get(limit)
    k, now, after = best_move(n_p, p_cap, n_c, c_cap)
    if k and now > 0 and after >= MIN_GAIN * now:
        src, dst = ("targets", "drafters") if k > 0 else ("drafters", "targets")
        return (f"move {abs(k)} GPU{'s' if abs(k) > 1 else ''} from {src} to {dst} (if the GPUs are alike): "
                f"est. {_tok(now)} -> {_tok(after)}")
    if limit == "targets" and p_cap > 0:
        return f"add target GPUs: the drafters could take ~{n_c * c_cap / (n_p * p_cap):.1f}x what the targets make"
    if limit == "drafters" and c_cap > 0:
        return f"add drafter GPUs: the targets could make ~{n_p * p_cap / (n_c * c_cap):.1f}x what the drafters train"
    return None


def _capacity(rate, waited: float) -> float:
    """Tokens/s a peer would do if it never waited: measured / (1 - fraction waited)."""
    return _num(rate, 0.0) / (1.0 - min(max(waited, 0.0), MAX_WAIT))


def _wait(c: dict) -> float:
    """Fraction of the last window a consumer had credit and nothing to get."""
    w = c.get("wait_frac")
    if isinstance(w, (int, float)):
        return float(w)
    return 1.0 if c.get("waiting_s") is not None else 0.0  # a map without the window: now only


def _straggler(cons: list[dict]) -> str:
    """The slowest drafter when it lags: in data-parallel training every rank waits for it."""
    if len(cons) < 2:
        return ""
    by_rate = sorted(cons, key=lambda c: _num(c.get("tokens_per_s"), 0.0))
    slow, others = by_rate[0], [_num(c.get("tokens_per_s"), 0.0) for c in by_rate[1:]]
    median = others[len(others) // 2] if len(others) % 2 else sum(others[len(others) // 2 - 1:][:2]) / 2
    r = _num(slow.get("tokens_per_s"), 0.0)
    if r >= 0.5 * median:
        return ""
    return f"; slowest drafter {_name(slow)} at {_tok(r)} (the others' median {_tok(median)})"


# ---------------------------------------------------------------- words


def _gpus(st: dict) -> bool:
    """Whether any peer runs on a GPU (a CPU run is never told to move GPUs)."""
    return any(isinstance(p.get("gpu"), int) and not isinstance(p.get("gpu"), bool) for p in st.get("peers") or [])


def _live(st: dict, role: str | None) -> list[dict]:
    return [p for p in st.get("peers") or [] if p.get("role") == role]


def _name(p: dict) -> str:
    return f"{p.get('peer')} ({p.get('instance')})"


def _num(v, default: float) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _tok(v: float) -> str:
    return f"{v / 1000:.1f} Ktok/s" if v >= 1000 else f"{v:.0f} tok/s"


def _bytes(n) -> str:
    n = _num(n, 0.0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "?"


def _dur(s) -> str:
    s = _num(s, 0.0)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}min"


def _util(p: dict) -> str:
    u = p.get("gpu_util")
    if isinstance(u, (int, float)):
        return f"{u:.0f}% util"
    return f"credit {p.get('credit', 0)}, nothing in flight"


def _mem(p: dict) -> str:
    used, total = p.get("gpu_mem_used"), p.get("gpu_mem_total")
    if isinstance(used, (int, float)) and isinstance(total, (int, float)) and total:
        return f" (GPU {p.get('gpu')}: {used / 2**30:.1f} of {total / 2**30:.1f} GiB used)"
    return ""
