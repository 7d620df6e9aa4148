"""The core's part for what training did (PROTOCOL.md 4.5): acks, commits of exactly what a
checkpoint's weights hold, late acks, and lineages (new weights send back what they do not hold).

A commit is final, so `refusal` checks it first: it must come from a session that speaks for its
lineage, for a step it acked, naming a finished checkpoint of that step where the broker can read
it; once a checkpoint was found on this host, a path it cannot find is refused too.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

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


MAX_LINEAGES_PER_SESSION = 16  # lineages one session's acks may name and be remembered for
MAX_CHECKPOINT_FILE = 1 << 20  # bytes of state.json / a safetensors header the broker reads


def checkpoint_problem(path: str, step: int, lineage: str) -> str | None:
    """Why `path` is not a finished checkpoint of `step` in `lineage`, or None; reads only the first MiB of
    regular files, since a peer names this path."""
    p = Path(path)
    for name in ("manifest.json", "state.json"):
        try:
            found = (p / name).is_file()
        except (OSError, ValueError):  # a name too long, say
            found = False
        if not found:
            return f"{path} is not a finished checkpoint (no {name})"
    try:
        with open(p / "state.json", "rb") as f:
            state = json.loads(f.read(MAX_CHECKPOINT_FILE))
    except (OSError, ValueError) as e:
        return f"{path}/state.json cannot be read ({type(e).__name__})"
    saved = state.get("step") if isinstance(state, dict) else None
    if saved != step:
        return f"{path} is the checkpoint of step {saved}, not {step}"
    saved_lineage = _record_lineage(p / "trained.safetensors")
    if lineage and saved_lineage is not None and saved_lineage != lineage:
        return f"{path} holds lineage {saved_lineage!r}, not {lineage!r}"
    return None


def _on_disk(path: str) -> bool:
    """Whether `path` is absolute and exists on this host (a peer chose it: never raises)."""
    try:
        return Path(path).is_absolute() and Path(path).exists()
    except (OSError, ValueError):
        return False


def _record_lineage(path: Path) -> str | None:
    """The lineage in a trained.safetensors header (record.py), None if absent or unreadable."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > MAX_CHECKPOINT_FILE:
                return None
            meta = json.loads(f.read(n)).get("__metadata__") or {}
    except (OSError, ValueError, struct.error, AttributeError):
        return None
    lin = meta.get("lineage") if isinstance(meta, dict) else None
    return lin if isinstance(lin, str) else None


class Commits:
    def __init__(self, run_id: str, ledger: Ledger, work: Work, shared_disk: bool = False):
        self.run_id, self.ledger, self.work = run_id, ledger, work
        # True once a checkpoint was found on this host: from then on a missing path is refused
        self.shared_disk = shared_disk
        self.lineages = Lineages()  # whose weights hold what
        self.trained: dict[str, TrainedBatch] = {}  # acked, not yet committed, by batch ID
        self.rate_samples = RateMeter(window_s=60.0)  # samples acked per second: the ETA

    def superseded(self, c: ConsumerSession, what: str, lineage: str, step: int) -> str | None:
        """Why `c`'s ack or commit must be refused (a newer lineage left its weights behind), else None."""
        kept = self.lineages.refused(lineage, step)
        if kept is None:
            return None
        log.warning("broker.lineage_superseded", peer=c.id, what=what, lineage=lineage or None, step=step,
                    kept_step=kept, head=self.lineages.head)
        return (f"{what} of step {step} from lineage {lineage or '(none)'}: a consumer has restarted the training "
                f"from a checkpoint since, keeping this lineage's steps up to {kept} only; these weights are no "
                "longer the run's: start this consumer again (it joins the running ones)")

    def acked(self, c: ConsumerSession, batches: list[Queued], lineage: str, step: int, now: float) -> None:
        """`c` trained `batches` at `step` of `lineage`; those a commit already holds are committed at once.
        An ack of batches makes `c` speak for `lineage` up to `step`."""
        if batches or lineage in c.lineage_steps:
            _speaks_for(c, lineage, step)
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
        """An ack after the commit that holds it (ranks ack apart): committed now, or a crash before the
        next commit would train them twice."""
        batches = [t.queued for t in late]
        n = self.ledger.committed_late(batches)
        for q in batches:
            self.trained.pop(q.batch_id, None)
        log.info("broker.ack_committed", peer=c.id, step=step, commit_step=last[0], checkpoint=last[1],
                 batch_ids=[q.batch_id for q in batches[:16]], samples=n, committed=self.ledger.counts["committed"])

    def refusal(self, c: ConsumerSession, m: Commit, lineage: str) -> tuple[str, str] | None:
        """(why, reason) when `c` may not commit `m` (module docstring), else None."""
        name = repr(lineage) if lineage else "\"\" (none named)"
        if lineage not in c.lineage_steps:
            return "not_lineage_consumer", (f"commit of lineage {name} from {c.id}, which neither started that lineage "
                                            "nor acked a step of it: only a consumer training those weights commits")
        if m.step > c.lineage_steps[lineage]:
            return "ahead_of_acks", (f"commit of step {m.step} from {c.id}, which acked lineage {name} up to step "
                                     f"{c.lineage_steps[lineage]} only: a checkpoint holds no step not yet trained")
        if not _on_disk(m.checkpoint):
            if self.shared_disk:
                return "no_checkpoint", (f"commit of step {m.step} names {m.checkpoint!r}, which does not exist on the "
                                         "broker's filesystem (where this run's checkpoints were found before)")
            return None  # on another filesystem: the broker cannot read it (PROTOCOL.md 4.5)
        problem = checkpoint_problem(m.checkpoint, m.step, lineage)
        if problem is not None:
            return "not_a_checkpoint", f"commit of step {m.step}: {problem}"
        if not self.shared_disk:
            log.info("broker.checkpoints_readable", peer=c.id, checkpoint=m.checkpoint, step=m.step)
            self.shared_disk = True
        return None

    def started_by(self, c: ConsumerSession, m: LineageStart) -> None:
        """`c` announced lineage `m.lineage`: it may commit it from the step the lineage started at."""
        lineage = m.lineage[:MAX_LINEAGE]
        if self.lineages.known(lineage):
            _speaks_for(c, lineage, self.lineages.parent[lineage][1])

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
        """Why `c`'s new lineage cannot be the run's (its weights would miss the newest commit), else None."""
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
        """A consumer starts a new lineage: what its weights do not hold goes back to the lease pool.
        Returns the samples sent back, or None for a known lineage."""
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


def _speaks_for(c: ConsumerSession, lineage: str, step: int) -> None:
    """Remember that `c` trains `lineage` up to `step` (the newest few lineages only)."""
    steps = c.lineage_steps
    if lineage not in steps and len(steps) >= MAX_LINEAGES_PER_SESSION:
        del steps[next(iter(steps))]
    steps[lineage] = max(step, steps.get(lineage, step))


def _parent(m: LineageStart) -> str | None:
    """The lineage `m` starts from, or None (from nothing)."""
    return m.parent[:MAX_LINEAGE] if isinstance(m.parent, str) and m.parent else None
