"""Broker resume (docs/DESIGN.md: "restarting from a checkpoint is one flag ... neither
repeats nor skips data"): a broker SIGKILLed mid-run is resumed as a new run with other
numbers of producers and consumers; counted from the two ledgers, every (epoch, sample)
is committed exactly once, and the parent run's files are not touched."""

from __future__ import annotations

import hashlib
import json
import time

import pytest
from tests.harness.ledger import committed, ledger_rows
from tests.harness.spawn import COMMITTING, finish, spawn
from tests.harness.wait import wait_until

from dflash.protocol.sample_order import epoch_order

pytestmark = pytest.mark.integration

N, EPOCHS, SEED = 60, 2, 7
ALL = {(e, s) for e in range(EPOCHS) for s in range(N)}


def _digest(run_dir) -> dict:
    """Bytes of every file of a run folder except SQLite's -shm index (rebuilt by readers)."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and not p.name.endswith("-shm")}


def _states(run_dir) -> dict:
    return dict(ledger_rows(run_dir, "SELECT state, COUNT(*) FROM samples GROUP BY state"))


def test_sigkilled_broker_resumes_with_other_peer_counts_and_commits_each_sample_once(brokers):
    t0 = time.monotonic()
    b1 = brokers("--lease-size", "6", "--epochs", str(EPOCHS), "--seed", str(SEED))
    # Paced so the kill finds every state at once: a fast producer fills the queue
    # (produced), a slow one holds leases (leased), both consumers prefetch (delivered),
    # and the fast consumer's acks run ahead of the slow one's commits (trained).
    run1 = [spawn(COMMITTING, "consumer", b1, "--instance", "fast", "--train-s", "0.05", "--prefetch", "2"),
            spawn(COMMITTING, "consumer", b1, "--instance", "slow", "--train-s", "0.1", "--prefetch", "2",
                  "--commit-every", "2")]
    run1.append(spawn(COMMITTING, "producer", b1, "--instance", "slow", "--n-samples", str(N), "--delay-s", "2"))
    b1.wait_event("broker.lease_granted", 20)  # the slow producer holds leases before the fast one joins
    run1.append(spawn(COMMITTING, "producer", b1, "--instance", "fast", "--n-samples", str(N), "--delay-s", "0.005"))
    wait_until(lambda: (b1.ask() or {}).get("samples", {}).get("committed", 0) >= 30, 60, "30 committed samples")
    b1.proc.kill()  # SIGKILL: no shutdown, no last flush
    b1.proc.wait(5)
    codes = finish(run1, 20)
    assert codes == [4, 4, 4, 4], [p.output[-3000:] for p in run1]  # each peer noticed the silent broker and exited 4
    before = _states(b1.run_dir)
    parent = set(committed(b1.run_dir))
    assert 0 < len(parent) < len(ALL)
    # The kill left work in flight in the states a resume must make again.
    assert {"leased", "produced", "delivered", "trained"} <= set(before), before
    parent_files = _digest(b1.run_dir)

    b2 = brokers("--resume", b1.run_id)
    info = json.loads((b2.run_dir / "run.json").read_text())
    assert info["parent_run"] == b1.run_id and info["resumed_from"]["committed_samples"] == len(parent)
    assert info["resumed_from"]["checkpoint"]["run"] == b1.run_id
    assert info["config"]["seed"] == SEED and info["config"]["epochs"] == EPOCHS
    run2 = [spawn(COMMITTING, "consumer", b2, "--instance", "solo", "--train-s", "0.01", "--commit-every", "3")]
    run2 += [spawn(COMMITTING, "producer", b2, "--instance", f"q{i}", "--n-samples", str(N)) for i in range(3)]
    assert finish(run2, 60) == [0, 0, 0, 0]
    assert b2.proc.wait(15) == 0

    child = committed(b2.run_dir)
    assert len(child) == len(set(child))
    assert parent.isdisjoint(child), "a sample committed before the kill was committed again"
    assert parent | set(child) == ALL, f"lost: {sorted(ALL - parent - set(child))[:10]}"
    inherited = ledger_rows(b2.run_dir, "SELECT epoch, sample, run FROM inherited")
    assert {(e, s) for e, s, _ in inherited} == parent and {r for _, _, r in inherited} == {b1.run_id}
    # Never leased again, so never trained again: the child's own rows avoid the parent's commits.
    touched = set(ledger_rows(b2.run_dir, "SELECT epoch, sample FROM samples"))
    assert touched == ALL - parent
    _check_order_continues(b2.run_dir, parent)
    assert _digest(b1.run_dir) == parent_files, "resume wrote into the parent run's files"
    print(f"resume: parent committed {len(parent)}, child {len(child)}, parent states at kill {before}, "
          f"{time.monotonic() - t0:.1f}s")


def _check_order_continues(run_dir, parent: set) -> None:
    """The child's leases, in grant order, are consecutive pieces of each epoch's shuffle
    (same seed) with the parent's committed samples left out."""
    rows = ledger_rows(run_dir, "SELECT lease, epoch, sample FROM samples ORDER BY lease")
    leases: dict[int, tuple[int, set]] = {}
    for lease, epoch, sample in rows:
        leases.setdefault(lease, (epoch, set()))[1].add(sample)
    expected = {e: [s for s in epoch_order(SEED, e, N) if (e, s) not in parent] for e in range(EPOCHS)}
    cursor = dict.fromkeys(expected, 0)
    for lease in sorted(leases):
        epoch, got = leases[lease]
        piece = expected[epoch][cursor[epoch]:cursor[epoch] + len(got)]
        assert set(piece) == got, f"lease {lease} of epoch {epoch} is not the next piece of the order"
        cursor[epoch] += len(got)
    assert all(cursor[e] == len(expected[e]) for e in expected)


def test_resume_refuses_what_would_repeat_or_skip_data(brokers, tmp_path):
    import subprocess
    import sys

    b1 = brokers("--epochs", "2", "--seed", "3", "--num-samples", "10")

    def resume(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dflash.broker.broker_command", "--runs-dir", str(tmp_path / "runs"),
                               "--port", "1", *args], capture_output=True, text=True, timeout=60)

    r = resume("--resume", b1.run_id)  # its broker is alive on this host
    assert r.returncode == 2 and "still being served" in r.stderr and str(b1.proc.pid) in r.stderr
    assert b1.stop() == 0
    for args, says in [(("--seed", "4"), "--seed 4 differs"), (("--epochs", "1"), "below"),
                       (("--num-samples", "11"), "--num-samples 11 differs")]:
        r = resume("--resume", b1.run_id, *args)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = resume("--resume", "20200101T000000Z-beef")
    assert r.returncode == 2 and "no run" in r.stderr


def test_resume_of_a_finished_run_refuses_unless_epochs_are_added(brokers):
    b1 = brokers("--lease-size", "4")
    procs = [spawn(COMMITTING, "consumer", b1, "--instance", "c"), spawn(COMMITTING, "producer", b1, "--n-samples", "8")]
    assert finish(procs, 30) == [0, 0] and b1.proc.wait(10) == 0
    with pytest.raises(RuntimeError, match="nothing is left to train"):
        brokers("--resume", b1.run_id)
    b2 = brokers("--resume", b1.run_id, "--epochs", "2")
    procs = [spawn(COMMITTING, "consumer", b2, "--instance", "c"), spawn(COMMITTING, "producer", b2, "--n-samples", "8")]
    assert finish(procs, 30) == [0, 0] and b2.proc.wait(10) == 0
    assert set(committed(b2.run_dir)) == {(1, s) for s in range(8)}  # only the added epoch
