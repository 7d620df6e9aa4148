"""`dflash-status`: the live state of a run, asked of its broker (`status` ->
`status_reply`, PROTOCOL.md 4.7), or the plain verdict on a run that is not live.

    dflash-status                      the run the broker serves now, with a diagnosis
    dflash-status --watch 2            the same, redrawn in place every 2 s
    dflash-status --json               the raw status map (fields: docs/STATUS.md)
    dflash-status --run latest         a run's verdict from its files: LIVE only if its
                                       broker answers with that run ID; else FINISHED,
                                       STOPPED or DIED, when, and its last step

Exit 0 on an answer, 1 when the broker does not answer (live mode) or the run is not
found, 2 on a bad option. Talks msgpack directly (no torch import), so it answers in a blink.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
import msgpack
import zmq

from dflash.protocol.curve import CurveClient, CurveKeyError, client_from
from dflash.protocol.messages import MAX_HEADER_BYTES, StatusAsk
from dflash.protocol.sockets import split_endpoint
from dflash.runtime.command_line import broker_option, command, curve_options, fail, option, runs_dir_option
from dflash.runtime.run import resolve_run, runs_root

from . import runstate
from .status_view import render

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: one frame drawn over the last


class NoAnswer(Exception):
    """The broker did not answer in time, or answered something that is not a status."""


def ask(endpoint: str, timeout_s: float, curve: CurveClient | None = None) -> dict:
    """One status round trip (CurveZMQ with `curve` keys). Raises NoAnswer."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 4 * MAX_HEADER_BYTES)
    if curve is not None:
        curve.apply(sock)
    try:
        sock.connect(endpoint)
        sock.send(msgpack.packb(StatusAsk().to_header()))
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


def _endpoint(broker: str) -> str:
    try:
        host, port = split_endpoint(broker)
    except ValueError as e:
        fail(str(e))
    return f"tcp://{host}:{port}"


def _latest_hint(runs_dir: str) -> str:
    """"; the latest run here is X (...)" so a silent broker is not read as 'nothing ran'."""
    latest = runs_root(runs_dir) / "latest"
    if not latest.exists():
        return ""
    return f"; latest run under {runs_root(runs_dir)} is {latest.resolve().name} (dflash-status --run latest)"


def show_live(endpoint: str, timeout_s: float, as_json: bool, runs_dir: str, curve=None) -> None:
    try:
        st = ask(endpoint, timeout_s, curve)
    except NoAnswer as e:
        fail(f"{e}{_latest_hint(runs_dir)}", code=1)
    click.echo(json.dumps(st, indent=2, sort_keys=True) if as_json else render(st))


def watch(endpoint: str, timeout_s: float, as_json: bool, every_s: float, curve=None) -> None:
    """Redraw until Ctrl-C; a broker that stops answering is said so in place, not fatal."""
    tty = sys.stdout.isatty()
    last_run = None
    try:
        while True:
            try:
                st = ask(endpoint, timeout_s, curve)
                last_run = st.get("run_id")
                frame = json.dumps(st, sort_keys=True) if as_json else render(st)
            except NoAnswer as e:
                gone = f" (last run seen: {last_run}; dflash-status --run {last_run})" if last_run else ""
                frame = (json.dumps({"error": str(e), "last_run": last_run}) if as_json
                         else f"{time.strftime('%H:%M:%S')} {e}{gone}")
            if as_json:
                click.echo(frame)  # JSON lines: one map per interval, for scripts
            elif tty:
                click.echo(CLEAR + frame + f"\n\n(every {every_s:g}s; Ctrl-C to quit)", nl=True)
            else:
                click.echo(frame + "\n")  # piped: frames one after another, no escape codes
            sys.stdout.flush()
            time.sleep(every_s)
    except KeyboardInterrupt:
        pass


def show_run(ref: str, runs_dir: str, broker: str | None, timeout_s: float, as_json: bool, curve=None) -> None:
    try:
        run_dir = resolve_run(ref, runs_dir)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e), code=1)

    def probe(endpoint: str) -> dict | None:
        try:
            return ask(_endpoint(endpoint), timeout_s, curve)
        except NoAnswer:
            return None

    d = runstate.describe(Path(run_dir), probe, broker)
    if as_json:
        click.echo(json.dumps(d, indent=2, sort_keys=True, default=str))
    elif d["live"]:
        click.echo(render(d["status"]))
        for n in d["notes"]:
            click.echo(f"note: {n}")
    else:
        click.echo(runstate.render(d))


@command("STATUS", max_content_width=100)
@broker_option()
@option("--json", "as_json", is_flag=True, default=False,
        help="Print the status map as JSON (with --watch: one compact map per line; with --run: the verdict).")
@option("--timeout-s", default=3.0, type=float,
        help="Seconds to wait for the broker's answer.")
@option("--watch", "-w", "watch_s", type=float, is_flag=False, flag_value=2.0, default=None, metavar="[SECS]",
        help="Redraw in place every SECS seconds (2 if no value) until Ctrl-C.")
@option("--run", "run_ref", default=None, metavar="ID|PATH|latest",
        help="Say what became of this run from its files (FINISHED/STOPPED/DIED, when, last step); "
             "LIVE only if its broker answers with that run ID.")
@runs_dir_option()
@curve_options
def main(broker: str, as_json: bool, timeout_s: float, watch_s: float | None, run_ref: str | None,
         runs_dir: str, curve_keys: str | None, curve_name: str | None) -> None:
    """Show the live state of the run a broker serves: progress and ETA, queue, every
    producer and consumer, lost peers, and what limits throughput now (with a
    suggestion). With --run, say plainly whether that run is live, finished or died."""
    if watch_s is not None and watch_s <= 0:
        fail("--watch SECS must be positive")
    try:
        curve = client_from(curve_keys, curve_name)
    except CurveKeyError as e:
        fail(str(e))
    if run_ref is not None:
        if watch_s is not None:
            fail("--watch follows the live run; leave out --run")
        source = click.get_current_context().get_parameter_source("broker")
        named = broker if source is not click.core.ParameterSource.DEFAULT else None
        show_run(run_ref, runs_dir, named, timeout_s, as_json, curve)
        sys.exit(0)
    endpoint = _endpoint(broker)
    if watch_s is not None:
        watch(endpoint, timeout_s, as_json, watch_s, curve)
    else:
        show_live(endpoint, timeout_s, as_json, runs_dir, curve)
    sys.exit(0)


if __name__ == "__main__":
    main()
