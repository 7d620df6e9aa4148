"""The core's part for what training did (PROTOCOL.md 4.5): batches acked (trained, not yet
committed), commits of exactly what a checkpoint's weights hold, acks that come after the
commit that holds them, and lineages: a consumer that starts new weights sends what they do
not hold back to be made again, and weights left behind are refused (lineage.py says which
batches a lineage's weights hold).
"""

from __future__ import annotations

from dflash.protocol.messages import Commit, LineageStart
from dflash.runtime.logs import get_logger

from .dispatch import Queued
from .ledger import Ledger
from .lineage import DEFAULT, MAX_LINEAGE, Lineages, TrainedBatch
from .liveness import RateMeter
from .peers import ConsumerSession
from .work import Work

log = get_logger()


def lineage_of(lin) -> str:
    """The lineage an ack or commit names ("" when it names none, or not as a string)."""
    return lin[:MAX_LINEAGE] if isinstance(lin, str) else DEFAULT


class Commits:
    def __init__(self, run_id: str, ledger: Ledger, work: Work):
        self.run_id, self.ledger, self.work = run_id, ledger, work
        self.lineages = Lineages()  # whose weights hold what
        self.trained: dict[str, TrainedBatch] = {}  # acked, not yet committed, by batch ID
        self.rate_samples = RateMeter(window_s=60.0)  # samples acked per second: the ETA

    def superseded(self, c: ConsumerSession, what: str, lineage: str, step: int) -> str | None:
        """Why `c`'s ack or commit of (`lineage`, `step`) must be refused (its weights were
        left behind by a newer lineage: its session ends), logged; else None."""
        kept = self.lineages.refused(lineage, step)
        if kept is None:
            return None
        log.warning("broker.lineage_superseded", peer=c.id, what=what, lineage=lineage or None, step=step,
                    kept_step=kept, head=self.lineages.head)
        return (f"{what} of step {step} from lineage {lineage or '(none)'}: a consumer has restarted the training "
                f"from a checkpoint since, keeping this lineage's steps up to {kept} only; these weights are no "
                "longer the run's: start this consumer again (it joins the running ones)")

    def acked(self, c: ConsumerSession, batches: list[Queued], lineage: str, step: int, now: float) -> None:
        """`c` trained `batches` at `step` of `lineage`'s weights; those a commit already holds
        (another rank's ack after rank 0's commit) are committed at once."""
        for q in batches:
            self.ledger.trained(q, c.id, step)
            self.trained[q.batch_id] = TrainedBatch(q, lineage, step, c.id)
            self.rate_samples.add(len(q.batch.samples), now)  # the ETA's pace
        last = self.ledger.last_commit
        if batches and last is not None:
            late = [self.trained[q.batch_id] for q in batches]
            if self.lineages.holds(self.lineages.last_commit_lineage or DEFAULT, last[0], late[0]):
                self.commit_late(c, step, late, last)

    def commit_late(self, c: ConsumerSession, step: int, late: list[TrainedBatch], last: tuple[int, str]) -> None:
        """An ack that comes after the commit whose checkpoint holds it (PROTOCOL.md 4.5: each
        rank acks on its own connection): committed now, not at the next commit (a crash in
        between would train them twice)."""
        batches = [t.queued for t in late]
        n = self.ledger.committed_late(batches)
        for q in batches:
            self.trained.pop(q.batch_id, None)
        log.info("broker.ack_committed", peer=c.id, step=step, commit_step=last[0], checkpoint=last[1],
                 batch_ids=[q.batch_id for q in batches[:16]], samples=n, committed=self.ledger.counts["committed"])

    def commit(self, c: ConsumerSession, m: Commit, lineage: str) -> None:
        """Commit exactly the trained batches the checkpoint's weights hold (lineage.py)."""
        step = m.step
        held = [t for t in self.trained.values() if self.lineages.holds(lineage, step, t)]
        n = self.ledger.committed(step, m.checkpoint, c.id, [t.queued for t in held])
        for t in held:
            del self.trained[t.queued.batch_id]
        self.lineages.last_commit_lineage = lineage
        log.info("broker.commit", peer=c.id, step=step, checkpoint=m.checkpoint, samples=n,
                 committed=self.ledger.counts["committed"], lineage=lineage or None, trained_left=len(self.trained))

    def stale_start(self, c: ConsumerSession, m: LineageStart) -> str | None:
        """Why `c`'s new lineage cannot be the run's (its weights would miss the newest
        commit: its session ends), logged as broker.lineage_stale; else None."""
        lineage, parent, step = m.lineage[:MAX_LINEAGE], _parent(m), m.step
        last = self.ledger.last_commit
        if self.lineages.known(lineage) or last is None:
            return None
        lin = self.lineages.last_commit_lineage or DEFAULT
        if parent is not None and self.lineages.caps(parent, step).get(lin, -1) >= last[0]:
            return None
        log.warning("broker.lineage_stale", peer=c.id, lineage=lineage, parent=parent, step=step,
                    checkpoint=m.checkpoint, commit_step=last[0], commit_checkpoint=last[1])
        return (f"this consumer started from {m.checkpoint or 'no checkpoint'} (step {step}), but the run has "
                f"committed step {last[0]} ({last[1]}) since: its weights would miss those samples; start it again "
                "(it then starts from the newest commit)")

    def start(self, c: ConsumerSession, m: LineageStart) -> int | None:
        """A consumer starts a new lineage (fresh, or from a checkpoint): what was trained that
        its weights do not hold goes back to the lease pool, to be made and trained again.
        Returns the samples sent back, or None when the lineage was known already."""
        lineage, parent, step = m.lineage[:MAX_LINEAGE], _parent(m), m.step
        if self.lineages.known(lineage):
            log.debug("broker.lineage_again", peer=c.id, lineage=lineage)
            return None
        self.lineages.start(lineage, parent, step)
        rewound = []
        for t in list(self.trained.values()):
            if t.lineage != lineage and not (parent is not None and self.lineages.holds(parent, step, t)):
                rewound.append(t)
                del self.trained[t.queued.batch_id]
                self.ledger.rewound(t.queued)
                self.work.remake(t.queued.batch.epoch, t.queued.batch.samples)
        n = sum(len(t.queued.batch.samples) for t in rewound)
        log.info("broker.lineage_started", peer=c.id, lineage=lineage, parent=parent, step=step,
                 checkpoint=m.checkpoint, rewound_samples=n)
        if rewound:
            log.warning("broker.samples_rewound", peer=c.id, lineage=lineage, step=step, samples=n,
                        batch_ids=[t.queued.batch_id for t in rewound[:16]], n_batches=len(rewound),
                        lineages=sorted({t.lineage or DEFAULT for t in rewound})[:8],
                        steps=[min(t.step for t in rewound), max(t.step for t in rewound)])
        return n

    def last_commit(self) -> dict | None:
        """The run's newest commit, for the broker's heartbeat (PROTOCOL.md 4.2)."""
        last = self.ledger.last_commit
        if last is None:
            return None
        return {"run": self.run_id, "step": last[0], "checkpoint": last[1],
                "lineage": self.lineages.last_commit_lineage}


def _parent(m: LineageStart) -> str | None:
    """The lineage `m` starts from, or None (from nothing)."""
    return m.parent[:MAX_LINEAGE] if isinstance(m.parent, str) and m.parent else None
