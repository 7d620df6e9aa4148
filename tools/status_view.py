"""The human view of a live status map (`dflash-status` without `--json`).

Layout, top to bottom: run ID and start time; progress and ETA; queue; rates; the
diagnosis with its suggestion; one table of targets (producers) and one of drafters
(consumers), every row starting with role, peer ID and instance; then the lost and
departed peers with when and why. Field meanings: docs/STATUS.md.
"""

from __future__ import annotations

from datetime import datetime


def size(n) -> str:
    if not isinstance(n, (int, float)):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "?"


def dur(s) -> str:
    if not isinstance(s, (int, float)):
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h{m:02d}m" if d else f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def clock(iso: str | None, fmt: str = "%H:%M:%SZ") -> str:
    if not iso:
        return "?"
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).strftime(fmt)
    except ValueError:
        return iso


def tok(v) -> str:
    if not isinstance(v, (int, float)):
        return "-"
    return f"{v / 1000:.1f}K" if v >= 1000 else f"{v:.0f}"


def _num(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _gpu_mem(p: dict) -> str:
    used, total = p.get("gpu_mem_used"), p.get("gpu_mem_total")
    if not isinstance(used, (int, float)) or not total:
        return "-"
    return f"{used / 2**30:.1f}/{total / 2**30:.1f}G"


def _pct(v) -> str:
    return f"{v:.0f}%" if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _share(v) -> str:
    """A fraction 0..1 as a percentage."""
    return _pct(100 * v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _live_state(state) -> str:
    """The broker answers, but a lost job trains no more: it must not read as running."""
    return "LIVE, JOB LOST (training cannot go on: resume the run)" if state == "job_lost" else f"LIVE ({state})"


def inherited(n) -> str:
    """A resumed run's samples committed by the runs before it: counted in its trained and
    committed figures (broker/status.py trained_figures), and said so."""
    return f" (incl. {n} from the resumed run)" if isinstance(n, int) and n else ""


def header(st: dict) -> list[str]:
    br, q, p, r = st.get("broker") or {}, st.get("queue") or {}, st.get("progress") or {}, st.get("rates") or {}
    s = st.get("samples") or {}
    lines = [f"run {st.get('run_id')}  started {clock(br.get('started_at'), '%Y-%m-%d %H:%M:%SZ')}  up "
             f"{dur(br.get('uptime_s'))}  {_live_state(br.get('state'))}  broker {br.get('instance')}@{br.get('host')} "
             f"pid {br.get('pid')}"]
    total = p.get("total")
    pct = f" ({100 * p['fraction']:.1f}%)" if isinstance(p.get("fraction"), (int, float)) else ""
    planned = p.get("planned")
    if isinstance(p.get("budget"), dict) and isinstance(planned, int) and planned != total:  # --time-budget
        pct += f", planned {planned}" + (f" ({100 * p['done'] / planned:.1f}%)" if planned and
                                         isinstance(p.get("done"), int) else "")
    eta = (f"ETA {dur(p['eta_s'])} ({clock(p.get('eta_at'), '%Y-%m-%d %H:%MZ')}) at {p.get('samples_per_s')} "
           "samples/s" if p.get("eta_s") is not None else "ETA -")
    epochs_done = _num(p.get("epochs_done"), ".2f")
    epoch = "-" if p.get("epoch") is None else p["epoch"] + 1  # 1-based for people
    lines.append(f"progress epoch {epoch}/"
                 f"{p.get('epochs', '?')} ({epochs_done} epochs done)  samples trained {p.get('trained', 0)} "
                 f"committed {p.get('committed', 0)}{inherited(p.get('inherited'))} of {total if total is not None else '?'}{pct}  skipped "
                 f"{s.get('skipped', 0)}  {eta}")
    if isinstance(p.get("budget"), dict):
        lines.append(budget_line(p["budget"], p))
    lines.append(f"queue    {q.get('batches', 0)} batches  {size(q.get('bytes'))} of {size(q.get('capacity_bytes'))}"
                 f"  oldest {dur(q.get('oldest_age_s'))}  in flight {q.get('in_flight_batches', 0)}"
                 f" ({size(q.get('in_flight_bytes'))})" + ("" if q.get("reading", True) else "  FULL: targets blocked"))
    peers = st.get("peers") or []
    t_in = sum(x.get("tokens_per_s") or 0 for x in peers if x.get("role") == "producer")
    t_out = sum(x.get("tokens_per_s") or 0 for x in peers if x.get("role") == "consumer")
    lines.append(f"rates    in {r.get('batches_in_per_s', 0):.2f} batch/s {tok(t_in)} tok/s  out "
                 f"{r.get('batches_out_per_s', 0):.2f} batch/s {tok(t_out)} tok/s")
    d = st.get("diagnosis")
    if d:
        lines.append(f"why      {d.get('text')}")
        if d.get("suggestion"):
            lines.append(f"         -> {d['suggestion']}")
        if isinstance(d.get("pending"), dict):  # hysteresis: a new diagnosis not yet steady
            lines.append(f"         (changing? {d['pending'].get('code')} for {dur(d['pending'].get('for_s'))})")
    return lines


def budget_line(b: dict, p: dict) -> str:
    """--time-budget: the time left, the plan and when it is trained at the current pace
    (no time at all while nothing is trained: a stall has no ETA)."""
    left = b.get("left_s")
    time_left = f"{dur(left)} left" if isinstance(left, (int, float)) and left >= 0 else f"deadline passed {dur(-left)} ago" \
        if isinstance(left, (int, float)) else "?"
    head = f"budget   {dur(b.get('budget_s'))}: {dur(b.get('elapsed_s'))} used, {time_left} (reserve {dur(b.get('reserve_s'))})"
    if b.get("state") != "planned":
        return f"{head}  plan: warm-up (the first plan {dur(b.get('every_s'))} after the first sample trained)"
    plan = f"  plan {b.get('planned_samples')} samples ({b.get('reason')}, at {b.get('rate')} samples/s)"
    eta = p.get("eta_s")
    if eta is None:
        return f"{head}{plan}  trained by: never at the current pace (nothing trained in the last minute)"
    return f"{head}{plan}  trained in {dur(eta)}"


def producer_rows(peers: list[dict]) -> list[str]:
    head = ["ROLE", "PEER", "INSTANCE", "HOST", "GPU", "STATE", "TOK/S", "Q_PRE", "IN FLIGHT", "HB AGE", "GPU MEM",
            "UTIL"]
    rows = [["producer", p["peer"], p["instance"], p["host"], _gpu(p), str(p.get("state")), tok(p.get("tokens_per_s")),
             _num(p.get("q_pre"), "d"), f"{p.get('in_flight', 0)} smp", dur(p.get("heartbeat_age_s")), _gpu_mem(p),
             _pct(p.get("gpu_util")) + (" OOM-BACKOFF" if p.get("oom_backoff") else "")] for p in peers]
    return table([head, *rows]) if rows else ["no live producers (targets)"]


def consumer_rows(peers: list[dict]) -> list[str]:
    head = ["ROLE", "PEER", "INSTANCE", "RANK", "HOST", "GPU", "STATE", "STEP", "TOK/S", "LOSS", "ACC", "STREAK",
            "CREDIT", "IN FLIGHT", "WAITED", "HB AGE", "GPU MEM", "UTIL"]
    rows = [["consumer", p["peer"], p["instance"], _num(p.get("rank"), "d"), p["host"], _gpu(p), str(p.get("state")),
             _num(p.get("step"), "d"), tok(p.get("tokens_per_s")), _num(p.get("loss"), ".4f"),
             _num(p.get("acc"), ".3f"),
             _num(p.get("streak"), ".2f"), str(p.get("credit", 0)), f"{p.get('in_flight', 0)} b",
             _pct(100 * p["wait_frac"]) if isinstance(p.get("wait_frac"), (int, float)) else "-",
             dur(p.get("heartbeat_age_s")), _gpu_mem(p), _pct(p.get("gpu_util"))] for p in peers]
    return table([head, *rows]) if rows else ["no live consumers (drafters)"]


def eval_rows(peers: list[dict], now_iso: str | None) -> list[str]:
    """The latest live evaluation of each consumer that runs one (`--eval-every`)."""
    now = _timestamp(now_iso)
    head = ["EVAL", "PEER", "INSTANCE", "STEP", "AGE", "SIM TAU", "SIM ACC", "UNSEEN", "TAU", "POOLED", "ACCEPTED",
            "SPEEDUP", "LOSSLESS", "COST"]
    rows = []
    for p in peers:
        e = p.get("eval")
        if not isinstance(e, dict):
            continue
        age = now - e["at"] if now is not None and isinstance(e.get("at"), (int, float)) else None
        prompts = e.get("prompts") or 0
        lossless = f"{prompts - (e.get('mismatches') or 0)}/{prompts}" if prompts else "-"
        overhead = e.get("overhead_frac")
        cost = _num(e.get("seconds"), ".2f") + "s" + (f" ({_share(overhead)})" if _share(overhead) != "-" else "")
        speedup = e.get("speedup")
        rows.append(["eval", p["peer"], p["instance"], _num(e.get("step"), "d"), dur(age),
                     _num(e.get("sim_tau"), ".2f"), _num(e.get("sim_acc"), ".3f"), _share(e.get("unseen_frac")),
                     _num(e.get("tau"), ".2f"), _num(e.get("tau_pooled"), ".2f"), _share(e.get("acceptance_rate")),
                     _num(speedup, ".2f") + ("x" if isinstance(speedup, (int, float)) else ""), lossless, cost])
    return table([head, *rows]) if rows else []


def _timestamp(iso: str | None) -> float | None:
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() if iso else None
    except ValueError:
        return None


def gone_rows(gone: list[dict]) -> list[str]:
    rows = []
    for g in gone:
        held = g.get("held") or {}
        if g.get("role") == "consumer":
            what = f"last step {g.get('last_step') if g.get('last_step') is not None else '?'}; " \
                   f"held {held.get('in_flight', 0)} unacked batches (requeued)"
        else:
            what = f"held {len(held.get('leases') or [])} leases, {held.get('samples_returned', 0)} samples returned"
        failure = g.get("failure") if isinstance(g.get("failure"), dict) else {}
        why = g.get("reason") or ""
        if failure:  # what the peer (or the broker, refusing its batch) said it stopped on
            why = f"{why}: {failure.get('code')}: {str(failure.get('reason'))[:120]}"
        rows.append([g.get("role", "?"), g.get("peer", "?"), g.get("instance", "?"), g.get("host", "?"), _gpu(g),
                     f"{g.get('state', '?')} {dur(g.get('ago_s'))} ago ({clock(g.get('at'))})", why, what])
    return table(rows)


def _gpu(p: dict) -> str:
    return "-" if p.get("gpu") is None else str(p["gpu"])


def bad_batch_lines(bad: dict) -> list[str]:
    """The run's bad batches by what became of them and why (status map `bad_batches`), or none."""
    def many(n, word: str) -> str:
        return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('h') else 's'}"

    parts = []
    for fault, n in sorted((bad.get("rejected") or {}).items()):
        parts.append(f"rejected {many(n['batches'], 'batch')} ({many(n['samples'], 'sample')}) at intake: {fault}")
    for fault, n in sorted((bad.get("quarantined") or {}).items()):
        parts.append(f"quarantined {many(n['batches'], 'batch')} ({many(n['samples'], 'sample')}: "
                     f"{n.get('remade', 0)} made again, {n.get('set_aside', 0)} set aside) after consumers failed "
                     f"on {'it' if n['batches'] == 1 else 'them'}: {fault}")
    return [f"bad      {p}" for p in parts]


def render(st: dict) -> str:
    peers = st.get("peers") or []
    lines = header(st) + bad_batch_lines(st.get("bad_batches") or {}) + [""]
    lines += producer_rows([p for p in peers if p.get("role") == "producer"]) + [""]
    lines += consumer_rows([p for p in peers if p.get("role") == "consumer"])
    evals = eval_rows([p for p in peers if p.get("role") == "consumer"], (st.get("broker") or {}).get("now"))
    if evals:
        lines += [""] + evals
    gone = st.get("gone") or []
    if gone:
        lines += ["", "GONE (lost or left; newest last)"] + gone_rows(gone)
    return "\n".join(lines)
