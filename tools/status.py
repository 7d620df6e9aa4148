"""`dflash-status`: the live state of a run, asked of its broker (`status` ->
`status_reply`, PROTOCOL.md 4.7).

Prints the run ID, uptime, queue depth, sample counts, one row per live peer and the
recently lost or departed ones with when and why. `--json` prints the raw status map
(fields in docs/LOGS.md). Exit 0 on an answer, 1 when the broker does not answer, 2 on a
bad option. Talks msgpack directly (no torch import) so it answers in a blink.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime

import click
import msgpack
import zmq

from dflash.protocol.config import broker_option, fail, option
from dflash.protocol.messages import MAX_HEADER_BYTES, PROTOCOL_VERSION
from dflash.protocol.sockets import split_endpoint


class NoAnswer(Exception):
    """The broker did not answer in time, or answered something that is not a status."""


def ask(endpoint: str, timeout_s: float) -> dict:
    """One status round trip. Raises NoAnswer."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 4 * MAX_HEADER_BYTES)
    try:
        sock.connect(endpoint)
        sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "type": "status"}))
        if not sock.poll(int(timeout_s * 1000)):
            raise NoAnswer(f"no answer from {endpoint} within {timeout_s:g}s (is dflash-broker running there?)")
        frames = sock.recv_multipart()
    finally:
        sock.close()
    try:
        h = msgpack.unpackb(frames[0], raw=False)
    except Exception as e:
        raise NoAnswer(f"{endpoint} answered something that is not msgpack ({type(e).__name__})") from None
    if not isinstance(h, dict) or h.get("type") not in ("status_reply", "reject"):
        raise NoAnswer(f"{endpoint} answered something that is not a status reply")
    if h["type"] == "reject":
        raise NoAnswer(f"{endpoint} refused: {h.get('reason')}")
    if not isinstance(h.get("status"), dict):
        raise NoAnswer(f"{endpoint} sent a status reply without a status map")
    return h["status"]


# ---------------------------------------------------------------- formatting


def _size(n) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "?"


def _dur(s) -> str:
    if s is None:
        return "-"
    s = float(s)
    if s < 60:
        return f"{s:.1f}s"
    m, s = divmod(int(s), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h{m:02d}m" if d else f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _rate(row: dict) -> str:
    st = row.get("stats") or {}
    bps = st.get("batches_per_s", row.get("batches_per_s"))
    tps = st.get("tokens_per_s", row.get("tokens_per_s"))
    out = f"{bps:.2f} b/s" if isinstance(bps, (int, float)) else "-"
    if isinstance(tps, (int, float)) and tps:
        out += f" {tps / 1000:.1f} Ktok/s"
    return out


def _detail(row: dict) -> str:
    st = row.get("stats") or {}
    if row["role"] == "producer":
        parts = [f"leases {row.get('leases_open', 0)}", f"batches {row.get('batches_in', 0)}"]
        if st.get("q_pre") is not None:
            parts.append(f"q_pre {st['q_pre']}")
        if row.get("stale"):
            parts.append(f"stale {row['stale']}")
    else:
        parts = [f"credit {row.get('credit', 0)}", f"in flight {row.get('in_flight', 0)}",
                 f"acked {row.get('acked', 0)}"]
        if row.get("rank") is not None:
            parts.insert(0, f"rank {row['rank']}")
        if st.get("step") is not None:
            parts.append(f"step {st['step']}")
        if row.get("waiting_s") is not None:
            parts.append(f"waiting {_dur(row['waiting_s'])}")
    if st.get("gpu_mem_used") is not None and st.get("gpu_mem_total"):
        parts.append(f"mem {_size(st['gpu_mem_used'])}/{_size(st['gpu_mem_total'])}")
    return ", ".join(parts)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _clock(iso: str | None) -> str:
    if not iso:
        return "?"
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).strftime("%H:%M:%SZ")
    except ValueError:
        return iso


def render(st: dict) -> str:
    br, q, s = st.get("broker", {}), st.get("queue", {}), st.get("samples", {})
    lines = [f"run {st.get('run_id')}  up {_dur(br.get('uptime_s'))}  state {br.get('state')}  "
             f"broker {br.get('instance')}@{br.get('host')} pid {br.get('pid')}"]
    lines.append(f"queue    {q.get('batches', 0)} batches  {_size(q.get('bytes'))} of {_size(q.get('capacity_bytes'))}"
                 f"  oldest {_dur(q.get('oldest_age_s'))}  in flight {q.get('in_flight_batches', 0)}"
                 f" ({_size(q.get('in_flight_bytes'))})" + ("" if q.get("reading", True) else "  FULL: producers blocked"))
    total, done = s.get("total"), s.get("done", 0)
    pct = f" ({100 * done / total:.1f}%)" if total else ""
    lines.append(f"samples  {done} of {total if total is not None else '?'} done{pct}  trained {s.get('trained', 0)}"
                 f"  committed {s.get('committed', 0)}  skipped {s.get('skipped', 0)}  in queue/flight "
                 f"{s.get('produced', 0) + s.get('delivered', 0)}  epoch {s.get('epoch', 0) + 1}/{s.get('epochs', '?')}")
    r = st.get("rates", {})
    lines.append(f"rates    in {r.get('batches_in_per_s', 0):.2f} batch/s  out {r.get('batches_out_per_s', 0):.2f} batch/s")
    peers = st.get("peers", [])
    lines.append("")
    if peers:
        head = ["ROLE", "PEER", "INSTANCE", "HOST", "GPU", "STATE", "RATE", "HB AGE", "DETAIL"]
        rows = [[p["role"], p["peer"], p["instance"], p["host"], "-" if p.get("gpu") is None else str(p["gpu"]),
                 p.get("state", "?"), _rate(p), _dur(p.get("heartbeat_age_s")), _detail(p)] for p in peers]
        lines += _table([head, *rows])
    else:
        lines.append("no live producers or consumers")
    gone = st.get("gone", [])
    if gone:
        lines += ["", "GONE"]
        rows = [[p["role"], p["peer"], p["instance"], p["host"], "-" if p.get("gpu") is None else str(p["gpu"]),
                 f"{p['state']} {_clock(p.get('at'))}", p.get("reason") or "",
                 _held(p.get("held") or {})] for p in gone]
        lines += _table(rows)
    return "\n".join(lines)


def _held(held: dict) -> str:
    if "in_flight" in held:
        return f"held {held['in_flight']} unacked batches (requeued)"
    if "samples_returned" in held:
        return f"held {len(held.get('leases', []))} leases, {held['samples_returned']} samples returned"
    return ""


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@broker_option()
@option("--json", "as_json", is_flag=True, default=False, envvar="DFLASH_STATUS_JSON",
        help="Print the raw status map as JSON (for scripts and jq).")
@option("--timeout-s", default=3.0, type=float, envvar="DFLASH_STATUS_TIMEOUT_S",
        help="Seconds to wait for the broker's answer.")
def main(broker: str, as_json: bool, timeout_s: float) -> None:
    """Show the live state of the run a broker serves: queue, samples, every peer."""
    try:
        host, port = split_endpoint(broker)
    except ValueError as e:
        fail(str(e))
    try:
        st = ask(f"tcp://{host}:{port}", timeout_s)
    except NoAnswer as e:
        fail(str(e), code=1)
    click.echo(json.dumps(st, indent=2, sort_keys=True) if as_json else render(st))
    sys.exit(0)


if __name__ == "__main__":
    main()
