"""The sample ledger: where every (epoch, sample) of the run stands, in SQLite (WAL).

States (PROTOCOL.md 7): pending -> leased -> produced -> delivered -> trained -> committed, or
skipped or quarantined; pending rows are not written (resume.py recomputes an epoch's order).
`inherited` holds what parent runs committed. Writes are batched and flushed by a thread of its
own so the loop never stalls on SQLite; a commit is written at once with fsync (synchronous=FULL).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

from dflash.runtime.run import StorageError
from dflash.runtime.threads import name_this_thread

SCHEMA_VERSION = 3  # 2: `inherited` (resume); 3: `bad_batches`, sample state `quarantined`

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS epochs(epoch INTEGER PRIMARY KEY, seed INTEGER NOT NULL,
    n_samples INTEGER NOT NULL, started REAL NOT NULL);
CREATE TABLE IF NOT EXISTS samples(epoch INTEGER NOT NULL, sample INTEGER NOT NULL,
    state TEXT NOT NULL, lease INTEGER, producer TEXT, batch_id TEXT, consumer TEXT,
    step INTEGER, reason TEXT, updated REAL NOT NULL,
    PRIMARY KEY(epoch, sample)) WITHOUT ROWID;
-- commit moves every trained sample up to a step: index only those rows
CREATE INDEX IF NOT EXISTS samples_trained ON samples(step) WHERE state = 'trained';
CREATE TABLE IF NOT EXISTS leases(lease INTEGER PRIMARY KEY, epoch INTEGER NOT NULL,
    producer TEXT NOT NULL, n INTEGER NOT NULL, state TEXT NOT NULL, granted REAL NOT NULL,
    closed REAL);
CREATE TABLE IF NOT EXISTS batches(batch_id TEXT PRIMARY KEY, producer TEXT, lease INTEGER,
    epoch INTEGER, n_samples INTEGER, tokens INTEGER, nbytes INTEGER, state TEXT NOT NULL,
    consumer TEXT, step INTEGER, deliveries INTEGER NOT NULL DEFAULT 0, received REAL,
    updated REAL);
CREATE TABLE IF NOT EXISTS commits(step INTEGER NOT NULL, checkpoint TEXT NOT NULL,
    peer TEXT, samples INTEGER NOT NULL, ts REAL NOT NULL);
-- committed by an earlier run of a resume chain: never made again in this run
CREATE TABLE IF NOT EXISTS inherited(epoch INTEGER NOT NULL, sample INTEGER NOT NULL,
    run TEXT NOT NULL, step INTEGER, PRIMARY KEY(epoch, sample)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS peers(peer TEXT PRIMARY KEY, role TEXT NOT NULL, instance TEXT,
    host TEXT, pid INTEGER, gpu INTEGER, joined REAL NOT NULL, gone REAL, outcome TEXT,
    reason TEXT);
-- batches refused at intake (action 'rejected': never queued, their samples stay with their
-- lease) or quarantined after consumers failed on them (samples remade or set aside)
CREATE TABLE IF NOT EXISTS bad_batches(batch_id TEXT, producer TEXT, lease INTEGER, epoch INTEGER,
    n_samples INTEGER NOT NULL, action TEXT NOT NULL, fault TEXT NOT NULL, reason TEXT,
    remade INTEGER NOT NULL DEFAULT 0, set_aside INTEGER NOT NULL DEFAULT 0, ts REAL NOT NULL);
"""

_SQL = {
    "lease": "INSERT INTO leases(lease, epoch, producer, n, state, granted) VALUES(?,?,?,?, 'open', ?)",
    "lease_close": "UPDATE leases SET state=?, closed=? WHERE lease=?",
    "leased": (
        "INSERT INTO samples(epoch, sample, state, lease, producer, updated) VALUES(?,?, 'leased', ?,?,?) "
        "ON CONFLICT(epoch, sample) DO UPDATE SET state='leased', lease=excluded.lease, "
        "producer=excluded.producer, batch_id=NULL, consumer=NULL, step=NULL, updated=excluded.updated"
    ),
    "pending": "UPDATE samples SET state='pending', lease=NULL, producer=NULL, updated=? WHERE epoch=? AND sample=?",
    "skipped": "UPDATE samples SET state='skipped', reason=?, updated=? WHERE epoch=? AND sample=?",
    "quarantined": "UPDATE samples SET state='quarantined', reason=?, updated=? WHERE epoch=? AND sample=?",
    # one statement for every write of a batch's row, so a flush sends them through one executemany
    "batch": (
        "INSERT INTO batches(batch_id, producer, lease, epoch, n_samples, tokens, nbytes, state, consumer, step,"
        " deliveries, received, updated) VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(batch_id) DO UPDATE SET"
        " producer=excluded.producer, lease=excluded.lease, epoch=excluded.epoch, n_samples=excluded.n_samples,"
        " tokens=excluded.tokens, nbytes=excluded.nbytes, state=excluded.state, consumer=excluded.consumer,"
        " step=excluded.step, deliveries=excluded.deliveries, received=COALESCE(excluded.received, received),"
        " updated=excluded.updated"
    ),
    "sample_state": (
        "UPDATE samples SET state=?, batch_id=?, consumer=?, step=?, updated=? WHERE epoch=? AND sample=?"
    ),
    "peer": "INSERT OR REPLACE INTO peers(peer, role, instance, host, pid, gpu, joined) VALUES(?,?,?,?,?,?,?)",
    "peer_gone": "UPDATE peers SET gone=?, outcome=?, reason=? WHERE peer=?",
    "epoch": "INSERT OR IGNORE INTO epochs(epoch, seed, n_samples, started) VALUES(?,?,?,?)",
    "bad_batch": "INSERT INTO bad_batches VALUES(?,?,?,?,?,?,?,?,?,?,?)",
}

_TABLE = {"lease": "leases", "lease_close": "leases", "leased": "samples", "pending": "samples",
          "skipped": "samples", "quarantined": "samples", "sample_state": "samples", "batch": "batches",
          "peer": "peers", "peer_gone": "peers", "epoch": "epochs", "bad_batch": "bad_batches"}
assert _TABLE.keys() == _SQL.keys()


_RECEIVED = 11  # the column of a _SQL["batch"] row a later write leaves alone when NULL


class Ledger:
    """Queued, batched writes of sample transitions, plus in-memory counts per state."""

    def __init__(self, path: Path, *, flush_s: float = 0.2, max_ops: int = 50_000, clock=time.monotonic):
        self.path = Path(path)
        self.flush_s, self.max_ops = flush_s, max_ops
        self._clock = clock  # when a flush is due (injected by tests)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        # from here on `db` is used only on this thread, in the order submitted
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="dflash-ledger",
                                          initializer=name_this_thread, initargs=("dflash-ledger",))
        self._writes: deque[Future] = deque()  # flushes handed over, not yet seen done
        self._ops: list[tuple[str, tuple]] = []  # in order: leases, peers, samples leased/pending/skipped
        # Rows written whole at each move: only the last before a flush counts, so keep them by key
        # (written after `_ops`: a sample's state moves only after its lease row).
        self._batches: dict[str, tuple] = {}
        self._states: dict[tuple[int, int], tuple] = {}
        self._last_flush = clock()
        self.counts: Counter[str] = Counter()
        self.flush_seconds = 0.0  # total time spent writing, for the status map
        # (step, checkpoint) of the newest commit: a later ack of a step <= it commits at once
        self.last_commit: tuple[int, str] | None = None
        self.broken: str | None = None  # why a write failed (StorageError): nothing more is written

    # ------------------------------------------------------------ run facts

    def set_meta(self, **items) -> None:
        rows = [(k, json.dumps(v)) for k, v in items.items()]
        self._now(self.db.executemany, "INSERT OR REPLACE INTO meta(key, value) VALUES(?,?)", rows)

    def meta(self) -> dict:
        rows = self._now(lambda: self.db.execute("SELECT key, value FROM meta").fetchall())
        return {k: json.loads(v) for k, v in rows}

    def inherit(self, rows: Iterable[tuple[int, int, str, int | None]], **meta) -> int:
        """Record (epoch, sample, run, step) committed by earlier runs, and `meta`, in ONE transaction
        (without its inherited rows a resumed ledger would make them again). Returns the rows written."""
        def write() -> int:
            with self.db:
                self.db.execute("BEGIN")
                n = self.db.executemany("INSERT INTO inherited VALUES(?,?,?,?)", rows).rowcount
                self.db.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES(?,?)",
                                    [(k, json.dumps(v)) for k, v in meta.items()])
            return n

        n = self._now(write)
        self.counts["inherited"] += n
        return n

    def epoch_started(self, epoch: int, seed: int, n_samples: int) -> None:
        self._op("epoch", (epoch, seed, n_samples, time.time()))

    # ------------------------------------------------------------ transitions

    def leased(self, lease_id: int, epoch: int, producer: str, samples: list[int]) -> None:
        now = time.time()
        self._op("lease", (lease_id, epoch, producer, len(samples), now))
        self._many("leased", ((epoch, s, lease_id, producer, now) for s in samples))
        self.counts["leased"] += len(samples)

    def lease_closed(self, lease_id: int, state: str) -> None:
        self._op("lease_close", (state, time.time(), lease_id))

    def released(self, epoch: int, samples: list[int]) -> None:
        """leased -> pending (the producer holding them was lost)."""
        now = time.time()
        self._many("pending", ((now, epoch, s) for s in samples))
        self.counts["leased"] -= len(samples)

    def skipped(self, epoch: int, pairs: list[tuple[int, str]]) -> None:
        now = time.time()
        self._many("skipped", ((reason, now, epoch, s) for s, reason in pairs))
        self.counts["leased"] -= len(pairs)
        self.counts["skipped"] += len(pairs)

    def produced(self, q) -> None:
        """A batch (dispatch.Queued) arrived: its samples leased -> produced."""
        now = time.time()
        self._batch_row(q, "queued", None, None, now, received=now)
        self._samples(q.batch, "produced", None, None, now)
        self._move("leased", "produced", len(q.batch.samples))

    def delivered(self, q, consumer: str) -> None:
        self._batch(q, "delivered", consumer, None)
        self._move("produced", "delivered", len(q.batch.samples))

    def requeued(self, q) -> None:
        """delivered -> produced: the consumer holding it was lost."""
        self._batch(q, "queued", None, None)
        self._move("delivered", "produced", len(q.batch.samples))

    def trained(self, q, consumer: str, step: int) -> None:
        self._batch(q, "trained", consumer, step)
        self._move("delivered", "trained", len(q.batch.samples))

    def committed(self, step: int, checkpoint: str, peer: str, batches: list | None = None) -> int:
        """`batches` (or every sample trained at a step <= `step`) -> committed, and the commit
        recorded; written at once, after every queued transition."""
        if batches is None:
            n = self._now(self._durably, self._commit_rows, step, checkpoint, peer, time.time())
        else:
            n = self._now(self._durably, self._commit_batches, batches, (step, checkpoint, peer), time.time())
        self._move("trained", "committed", n)
        if self.last_commit is None or step >= self.last_commit[0]:
            self.last_commit = (step, checkpoint)
        return n

    def committed_late(self, batches: list) -> int:
        """Batches acked at a step <= the last commit -> committed, fsync'd: another rank's ack of step N
        can follow rank 0's commit of N, whose checkpoint holds them. Returns the samples moved."""
        n = self._now(self._durably, self._commit_batches, batches, None, time.time())
        self._move("trained", "committed", n)
        return n

    def rewound(self, q) -> None:
        """trained -> pending: a consumer restarted from a checkpoint older than `q`'s training (lineage.py)."""
        now = time.time()
        self._batch_row(q, "rewound", None, None, now)
        b = q.batch
        for s in b.samples:  # a queued `trained` row of these must not land after this
            self._states.pop((b.epoch, s), None)
        self._many("pending", ((now, b.epoch, s) for s in b.samples))
        self.counts["trained"] -= len(b.samples)

    def rejected(self, b, fault: str, reason: str) -> None:
        """Batch `b` was refused at intake: a `bad_batches` row; its samples' states do not move."""
        self._op("bad_batch", (b.batch_id, b.producer, b.lease, b.epoch, len(b.samples), "rejected", fault, reason,
                               0, 0, time.time()))

    def quarantined(self, q, remade: list[int], aside: list[int], fault: str, reason: str) -> None:
        """Batch `q` was quarantined: `remade` -> pending, `aside` -> quarantined, and a `bad_batches` row."""
        now = time.time()
        self._batch_row(q, "quarantined", None, None, now)
        b = q.batch
        for s in b.samples:  # a queued `delivered` row of these must not land after this
            self._states.pop((b.epoch, s), None)
        self._many("pending", ((now, b.epoch, s) for s in remade))
        self._many("quarantined", ((f"{fault}: {reason}", now, b.epoch, s) for s in aside))
        self._op("bad_batch", (b.batch_id, b.producer, b.lease, b.epoch, len(b.samples), "quarantined", fault, reason,
                               len(remade), len(aside), now))
        self.counts["delivered"] -= len(b.samples)
        self.counts["quarantined"] += len(aside)

    def _durably(self, write, *args):
        """`write(*args)` in a transaction that is fsync'd (synchronous=FULL): a commit."""
        self.db.execute("PRAGMA synchronous=FULL")
        try:
            return write(*args)
        finally:
            self.db.execute("PRAGMA synchronous=NORMAL")  # the rest may be made again

    def _commit_batches(self, batches: list, commit: tuple | None, now: float) -> int:
        """Acked batches -> committed by primary key (no table scan), and the commit's row if given."""
        with self.db:
            self.db.execute("BEGIN")
            n = 0
            for q in batches:
                n += self.db.executemany("UPDATE samples SET state='committed', updated=? WHERE epoch=? "
                                         "AND sample=? AND state='trained'",
                                         [(now, q.batch.epoch, s) for s in q.batch.samples]).rowcount
            self.db.executemany("UPDATE batches SET state='committed', updated=? WHERE batch_id=? "
                                "AND state='trained'", [(now, q.batch.batch_id) for q in batches])
            if commit is not None:
                self.db.execute("INSERT INTO commits VALUES(?,?,?,?,?)", (*commit[:2], commit[2], n, now))
        return n

    def _commit_rows(self, step: int, checkpoint: str, peer: str, now: float) -> int:
        with self.db:
            self.db.execute("BEGIN")
            n = self.db.execute(
                "UPDATE samples SET state='committed', updated=? WHERE state='trained' AND step<=?", (now, step)
            ).rowcount
            self.db.execute(
                "UPDATE batches SET state='committed', updated=? WHERE state='trained' AND step<=?", (now, step)
            )
            self.db.execute("INSERT INTO commits VALUES(?,?,?,?,?)", (step, checkpoint, peer, n, now))
        return n

    def peer_joined(self, p) -> None:
        self._op("peer", (p.id, p.role, p.instance, p.host, p.pid, p.gpu, time.time()))

    def skip_reasons(self) -> dict[str, int]:
        """Skipped and quarantined samples by reason (before its first ':'), once flushed."""
        rows = self._now(lambda: self.db.execute(
            "SELECT reason, COUNT(*) FROM samples WHERE state IN ('skipped', 'quarantined') GROUP BY reason").fetchall())
        out: dict[str, int] = {}
        for reason, n in rows:
            key = str(reason or "unknown").split(":", 1)[0].strip()[:64]
            out[key] = out.get(key, 0) + n
        return out

    def peer_gone(self, peer_id: str, outcome: str, reason: str) -> None:
        self._op("peer_gone", (time.time(), outcome, reason, peer_id))

    # ------------------------------------------------------------ writing

    def _batch(self, q, state: str, consumer: str | None, step: int | None) -> None:
        now = time.time()
        self._batch_row(q, state, consumer, step, now)
        sample_state = "produced" if state == "queued" else state
        self._samples(q.batch, sample_state, consumer, step, now)

    def _batch_row(self, q, state: str, consumer: str | None, step: int | None, now: float,
                   received: float | None = None) -> None:
        b = q.batch
        if received is None and b.batch_id in self._batches:  # NULL keeps the stored value: carry it
            received = self._batches[b.batch_id][_RECEIVED]
        self._batches[b.batch_id] = (b.batch_id, b.producer, b.lease, b.epoch, len(b.samples), b.tokens, q.nbytes,
                                     state, consumer, step, q.deliveries, received, now)

    def _samples(self, b, state: str, consumer: str | None, step: int | None, now: float) -> None:
        for s in b.samples:
            self._states[b.epoch, s] = (state, b.batch_id, consumer, step, now, b.epoch, s)
        self._maybe_full()

    def _move(self, old: str, new: str, n: int) -> None:
        self.counts[old] -= n
        self.counts[new] += n

    def _op(self, key: str, row: tuple) -> None:
        self._ops.append((key, row))
        self._maybe_full()

    def _many(self, key: str, rows: Iterable[tuple]) -> None:
        for r in rows:
            self._ops.append((key, r))
        self._maybe_full()

    def _maybe_full(self) -> None:
        if len(self._ops) + len(self._batches) + len(self._states) >= self.max_ops:
            self.flush()

    def maybe_flush(self, now: float | None = None) -> None:
        if (self._ops or self._batches or self._states) and (now or self._clock()) - self._last_flush >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        """Hand every queued transition to the writer thread as one transaction; raises an earlier write's error."""
        self._last_flush = self._clock()
        if self.broken is not None:
            raise StorageError(self.broken)
        while self._writes and self._writes[0].done():
            self._result(self._writes.popleft())  # raises what the write raised (disk full, ...)
        if not (self._ops or self._batches or self._states):
            return
        ops, self._ops = self._ops, []
        # grouped by table (each statement writes one), in order within each: few long executemany runs
        ops.sort(key=lambda op: _TABLE[op[0]])
        ops += [("batch", r) for r in self._batches.values()]
        ops += [("sample_state", r) for r in self._states.values()]
        self._batches, self._states = {}, {}
        self._writes.append(self._writer.submit(self._write, ops))

    def sync(self) -> None:
        """flush(), then wait until everything queued is written."""
        self.flush()
        while self._writes:
            self._result(self._writes.popleft())

    def _now(self, fn, *args):
        """fn(*args) on the writer thread, after every queued transition; its result."""
        self.sync()
        return self._result(self._writer.submit(fn, *args))

    def _result(self, fut: Future):
        """A write's result; a write the disk refused raises StorageError and the broker stops."""
        if self.broken is not None:
            raise StorageError(self.broken)
        try:
            return fut.result()
        except (sqlite3.OperationalError, OSError) as e:
            self.broken = f"cannot write the ledger {self.path}: {e}"
            raise StorageError(self.broken) from e

    def _write(self, ops: list[tuple[str, tuple]]) -> None:
        t0 = time.perf_counter()
        with self.db:
            self.db.execute("BEGIN")
            i = 0
            while i < len(ops):  # runs of one statement go through executemany
                j = i
                while j < len(ops) and ops[j][0] == ops[i][0]:
                    j += 1
                self.db.executemany(_SQL[ops[i][0]], [r for _, r in ops[i:j]])
                i = j
        self.flush_seconds += time.perf_counter() - t0

    def close(self) -> None:
        try:
            if self.broken is None:  # a refused write is not retried: what SQLite committed stays
                self._now(self.db.execute, "PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            self._writer.submit(self.db.close).result()
            self._writer.shutdown()
