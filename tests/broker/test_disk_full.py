"""A full disk under the broker (issue 36, finding 5): the broker stops without a traceback,
says why on stderr, logs `broker.storage_failed`, writes run.json's outcome `storage_failed`
with the cause (in place: there is no room for a new file), and `dflash-status --run` says
it. The ledger alone on a full disk raises StorageError on its flush and still closes.

The disk is a real one: a small tmpfs mounted for the test (root only; skipped otherwise),
filled with a file once the run is under way, so every write of the run folder gets ENOSPC
("No space left on device", SQLite's "database or disk is full"). RLIMIT_FSIZE is no
substitute: it gives EFBIG (and SIGXFSZ), not ENOSPC."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dflash.broker.ledger import Ledger
from dflash.runtime.run import StorageError
from tests.harness.broker import BrokerProc
from tests.harness.spawn import FAKES, spawn
from tests.harness.wait import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs at tmp_path/disk, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    where = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _fill(disk: Path) -> None:
    subprocess.run(["dd", "if=/dev/zero", f"of={disk / 'filler'}", "bs=64k"], capture_output=True)


def test_a_full_disk_stops_the_broker_with_its_reason_everywhere_it_can_be_written(small_disk):
    b = BrokerProc(small_disk / "runs", ["--epochs", "1"])
    peers = [spawn(FAKES, "consumer", b, "--instance", "c0", "--train-s", "0.02"),
             spawn(FAKES, "producer", b, "--n-samples", "4000", "--delay-s", "0.01")]
    try:
        wait_until(lambda: (b.ask() or {}).get("samples", {}).get("trained", 0) > 10 or b.proc.poll() is not None,
                   120, "training under way")
        _fill(small_disk)
        rc = b.proc.wait(60)
        time.sleep(0.3)  # its stderr reader
        err = "\n".join(b.stderr)
        assert rc == 1 and "Traceback" not in err, err[-3000:]
        assert f"error: broker stopped run {b.run_id}: cannot write" in err and "--resume" in err, err
        (ev,) = b.events("broker.storage_failed")  # its stdout goes on when its log file cannot
        assert "No space left on device" in ev["error"] or "database or disk is full" in ev["error"], ev
        info = json.loads((b.run_dir / "run.json").read_text())
        assert info["outcome"] == "storage_failed" and info["error"] == ev["error"] and info["ended_at"], info
        st = subprocess.run([sys.executable, "-m", "dflash.tools.status_command", "--runs-dir", str(b.runs_dir),
                             "--run", b.run_id], capture_output=True, text=True, timeout=60)
        assert "DIED" in st.stdout and "the disk refused a write" in st.stdout and "--resume" in st.stdout, st
    finally:
        for p in [*peers, b.proc]:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def test_a_ledger_on_a_full_disk_raises_storage_error_and_still_closes(small_disk):
    ledger = Ledger(small_disk / "ledger.sqlite", flush_s=0.0)
    ledger.epoch_started(0, 0, 100_000)
    _fill(small_disk)
    with pytest.raises(StorageError, match="cannot write the ledger .*(full|space)"):
        for lease in range(2000):  # until a flush meets the full disk
            ledger.leased(lease, 0, "p", list(range(lease * 50, lease * 50 + 50)))
            ledger.sync()
    with pytest.raises(StorageError):  # nothing more is written, and said so again
        ledger.sync()
    ledger.close()
