"""dflash-logs: one run's logs from every role, merged in time order.

Defaults to the latest run and always says which run it shows, so an old run's lines are
never mistaken for the live one's (docs/DESIGN.md incident 5).
"""

from __future__ import annotations

import json
import sys
import time

import click

from dflash.runtime.command_line import command, fail, option, runs_dir_option
from dflash.runtime.run import resolve_run

from .runlogs import log_files, matches, merged


def _render(ev: dict, as_json: bool) -> str:
    if as_json:
        return json.dumps(ev)
    rest = " ".join(f"{k}={v}" for k, v in ev.items()
                    if k not in ("ts", "level", "event", "run_id", "role", "instance", "host", "pid"))
    return f"{ev.get('ts', '?')} {ev.get('level', '?'):<7} {ev.get('role', '?')}-{ev.get('instance', '?')} {ev.get('event', '?')} {rest}"


@command("LOGS")
@option("--run", "run_ref", default="latest", help="Run ID, run folder, or 'latest'.")
@runs_dir_option()
@option("--role", "roles", multiple=True, help="Only these roles (broker, producer, consumer); repeatable.")
@option("--instance", "instances", multiple=True, help="Only these instances; repeatable.")
@option("--level", "levels", multiple=True, help="Only these levels (debug, info, warning, error); repeatable.")
@option("--event", "events", multiple=True, help="Only these events; 'train' matches train.*; repeatable.")
@option("--json", "as_json", is_flag=True, default=False, help="Print raw JSON lines (for jq).")
@option("--follow", "-f", is_flag=True, default=False, help="Keep printing new lines as they are written.")
def main(run_ref, runs_dir, roles, instances, levels, events, as_json, follow):
    """Print a run's JSON logs from all roles in time order, filtered."""
    try:
        run_dir = resolve_run(run_ref, runs_dir)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    click.echo(f"# run {run_dir.name} ({run_dir})", err=True)
    filt = dict(roles=roles, instances=instances, levels=levels, events=events)
    for ev in merged(run_dir):
        if matches(ev, **filt):
            click.echo(_render(ev, as_json))
    if follow:
        _follow(run_dir, filt, as_json)


def _follow(run_dir, filt, as_json) -> None:
    """Tail every file of the run (new files too); lines are printed as they come."""
    offsets = {p: p.stat().st_size for p in log_files(run_dir)}
    try:
        while True:
            for p in log_files(run_dir):
                start = offsets.get(p, 0)
                size = p.stat().st_size
                if size <= start:
                    continue
                with open(p, "rb") as f:
                    f.seek(start)
                    chunk = f.read(size - start)
                complete = chunk.rfind(b"\n") + 1  # keep a half-written line for next time
                offsets[p] = start + complete
                for line in chunk[:complete].decode(errors="replace").splitlines():
                    try:
                        ev = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if matches(ev, **filt):
                        click.echo(_render(ev, as_json))
            sys.stdout.flush()
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
