"""run.json: what a run is (config, versions, host, start, parent) and how it ended, written atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash.protocol.fields import PROTOCOL_VERSION
from dflash.runtime.logs import get_logger
from dflash.runtime.run import hostname, iso_utc, write_json_atomic, write_run_json

from .leases import LeasePool
from .ledger import Ledger


def start(run_dir: Path, run_id: str, config: dict, endpoints: dict, instance: str,
          parent_run: str | None = None, resumed_from: dict | None = None) -> dict:
    """Write the first run.json of a new run (with the broker's own fields); returns it."""
    return write_run_json(run_dir, run_id, config=config, parent_run=parent_run, resumed_from=resumed_from,
                          ended_at=None, outcome="running", protocol_version=PROTOCOL_VERSION,
                          broker={"host": hostname(), "pid": os.getpid(), "instance": instance,
                                  "endpoints": endpoints},
                          facts={})


def update(run_dir: Path, **fields) -> None:
    """Merge `fields` into run.json (top level); on a full disk in place (its end must be said)."""
    path = run_dir / "run.json"
    info = json.loads(path.read_text())
    info.update(fields)
    write_json_atomic(path, info, in_place_if_full=True)


def finish(run_dir: Path, outcome: str, wall: float, **fields) -> None:
    """The run ended with `outcome` at `wall` (the wall clock's seconds)."""
    update(run_dir, outcome=outcome, ended_at=iso_utc(wall), **fields)


def end_of_stream_outcome(ledger: Ledger, pool: LeasePool) -> tuple[str, str | None]:
    """`completed`, or `nothing_to_train` with why (logged) when no sample was trained or inherited."""
    counts = ledger.counts
    if counts["trained"] + counts["committed"] + counts["inherited"] > 0:
        return "completed", None
    n = pool.n_samples if pool.known else None
    if not n:
        why = "the dataset has 0 samples (an empty data file?)"
        reasons: dict = {}
    else:
        reasons = ledger.skip_reasons()
        listed = ", ".join(f"{v} {k}" for k, v in sorted(reasons.items(), key=lambda x: -x[1]))
        aside = " or set aside as poison" if counts["quarantined"] else ""
        why = (f"every sample was skipped{aside} ({listed or str(counts['skipped']) + ' skipped'}) and none trained"
               + ("; no_loss_tokens: no assistant token fits in --max-length" if "no_loss_tokens" in reasons else ""))
    log = get_logger()
    log.error("broker.nothing_to_train", why=why, n_samples=n, skipped=counts["skipped"],
              quarantined=counts["quarantined"], reasons=reasons)
    return "nothing_to_train", why
