"""Resume policy in-process: the lease pool of a resumed run walks each epoch's shuffle
without the committed samples, and the parent's ledger is read as it lies after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.broker import resume
from dflash.broker.leases import LeasePool
from dflash.protocol.sample_order import epoch_order
from dflash.broker.ledger import Ledger
from dflash.broker.dispatch import Queued
from dflash.protocol.batch import Batch

pytestmark = pytest.mark.integration


def _drain(pool: LeasePool, want: int = 5) -> list[tuple[int, list[int]]]:
    out = []
    while (lease := pool.grant("p1", want)) is not None:
        out.append((lease.epoch, lease.samples))
        pool.arrived(lease.id, "p1", lease.epoch, lease.samples)
        pool.close_if_complete(lease)
    return out


def test_pool_skips_committed_samples_and_whole_epochs_in_the_same_order():
    n, seed = 20, 5
    committed = {0: bytearray([1] * n), 1: bytearray(n)}  # epoch 0 all done, epoch 1 a few
    for s in (3, 7, 11):
        committed[1][s] = 1
    pool = LeasePool(3, seed, n, committed)
    assert pool.pending() == (n - 3) + n
    got = _drain(pool)
    assert [e for e, _ in got][:1] == [1]  # epoch 0 is skipped entirely
    by_epoch = {e: [s for ee, ss in got if ee == e for s in ss] for e in (1, 2)}
    assert by_epoch[1] == [s for s in epoch_order(seed, 1, n) if s not in (3, 7, 11)]
    assert by_epoch[2] == epoch_order(seed, 2, n)  # an epoch with nothing committed is untouched
    assert pool.pending() == 0 and pool.finished()


def test_pool_refuses_committed_bitmaps_of_another_dataset_size():
    with pytest.raises(ValueError, match="another dataset size"):
        LeasePool(1, 0, 10, {0: bytearray(11)})


KILL_AFTER_COMMIT = """
import os, signal, sys
from dflash.broker.dispatch import Queued
from dflash.broker.ledger import Ledger
from dflash.protocol.batch import Batch
led = Ledger(sys.argv[1])
led.set_meta(run_id="20260101T000000Z-aaaa")
b = Queued(Batch("p1-1", "p1", 1, 0, [4, 5], [4, 4], [1]), nbytes=64, queued_at=0.0, deliveries=1)
led.leased(1, 0, "p1", [4, 5, 6])
led.produced(b); led.delivered(b, "c1"); led.trained(b, "c1", 3)
led.committed(3, "ckpt/step-3", "c1")
led.leased(2, 0, "p1", [7])  # queued, never flushed: the kill loses it
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_parent_ledger_is_read_from_a_copy_as_it_lies_after_sigkill(tmp_path):
    run_dir = tmp_path / "runs" / "20260101T000000Z-aaaa"
    run_dir.mkdir(parents=True)
    info = {"run_id": run_dir.name, "config": {"seed": 9, "epochs": 2, "num_samples": 10}, "outcome": "running",
            "broker": {"host": "elsewhere", "pid": 1}, "facts": {}}
    (run_dir / "run.json").write_text(json.dumps(info))
    p = subprocess.run([sys.executable, "-c", KILL_AFTER_COMMIT, str(run_dir / "ledger.sqlite")], timeout=60)
    assert p.returncode == -signal.SIGKILL
    wal = run_dir / "ledger.sqlite-wal"
    assert wal.exists() and wal.stat().st_size > 0  # the commit lives only in the WAL
    files = {f.name: f.read_bytes() for f in run_dir.iterdir()}

    parent = resume.load(str(run_dir), tmp_path / "runs")
    assert (parent.seed, parent.epochs, parent.n_samples) == (9, 2, 10)
    assert sorted(parent.rows) == [(0, 4, run_dir.name, 3), (0, 5, run_dir.name, 3)]
    assert parent.resumed_from == {"run": run_dir.name, "step": 3, "checkpoint": "ckpt/step-3"}
    assert {f.name: f.read_bytes() for f in run_dir.iterdir()} == files  # not one byte written

    child = Ledger(tmp_path / "child.sqlite")
    assert resume.inherit(child, parent) == 2
    meta = child.meta()
    assert meta["parent_run"] == run_dir.name and meta["resumed_from"]["step"] == 3
    child.close()
    os.remove(tmp_path / "child.sqlite")


def _run_folder(root, run_id: str, parent: str | None = None) -> Path:
    d = root / run_id
    d.mkdir(parents=True)
    info = {"run_id": run_id, "config": {"seed": 1, "epochs": 1, "num_samples": 6}, "outcome": "completed",
            "broker": {}, "facts": {}, "parent_run": parent}
    (d / "run.json").write_text(json.dumps(info))
    return d


def _commit(led: Ledger, samples: list[int], step: int, bid: str) -> None:
    b = Queued(Batch(bid, "p1", 1, 0, samples, [2] * len(samples), [1]), nbytes=8, queued_at=0.0, deliveries=1)
    led.leased(1, 0, "p1", samples)
    led.produced(b)
    led.delivered(b, "c1")
    led.trained(b, "c1", step)
    led.committed(step, f"ckpt/step-{step}", "c1")


def test_a_chain_of_resumes_inherits_every_ancestors_commits_with_who_committed_them(tmp_path):
    root = tmp_path / "runs"
    a, b = "20260101T000000Z-aaaa", "20260101T010000Z-bbbb"
    led_a = Ledger(_run_folder(root, a) / "ledger.sqlite")
    led_a.set_meta(run_id=a)
    _commit(led_a, [0, 1], 5, "p1-1")
    led_a.close()
    pa = resume.load(a, root)
    led_b = Ledger(_run_folder(root, b, parent=a) / "ledger.sqlite")
    resume.inherit(led_b, pa)
    led_b.set_meta(run_id=b)
    led_b.close()
    pb = resume.load(b, root)  # B committed nothing itself: the chain's newest commit is still A's
    assert pb.resumed_from == {"run": a, "step": 5, "checkpoint": "ckpt/step-5"}
    led_b = Ledger(root / b / "ledger.sqlite")
    _commit(led_b, [4], 2, "p1-1")
    led_b.close()
    pb = resume.load(b, root)
    assert sorted((e, s, r) for e, s, r, _ in pb.rows) == [(0, 0, a), (0, 1, a), (0, 4, b)]
    assert pb.resumed_from == {"run": b, "step": 2, "checkpoint": "ckpt/step-2"}
    assert pb.committed[0] == bytearray([1, 1, 0, 0, 1, 0])
