"""The run's phase and how it ends (PROTOCOL.md 4.6): one enum instead of loose flags."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Phase(enum.Enum):
    """Where the run stands (PROTOCOL.md 4.6). RUNNING -> ENDING -> DONE at end of stream;
    RUNNING/JOB_LOST/ENDING -> DRAINING -> DONE on a signal; RUNNING <-> JOB_LOST."""

    RUNNING = "running"
    JOB_LOST = "job_lost"  # the training job died with uncommitted work: new consumers are refused
    ENDING = "ending"  # end of stream: every peer was told `stop`; waiting for them to leave
    DRAINING = "draining"  # a shutdown: peers told `stop {shutdown}`; waiting at most --drain-s
    DONE = "done"  # the outcome is decided: the loop ends


@dataclass
class RunEnd:
    """How the run is ending, from the moment peers are told to stop."""

    reason: str  # what `stop` says: end_of_stream, or shutdown (a signal)
    told: set[str] = field(default_factory=set)  # peers told to stop (joiners are told too)
    deadline: float | None = None  # a shutdown's drain deadline (monotonic)
    cause: str | None = None  # a shutdown's cause, e.g. "signal SIGTERM"
    outcome: str | None = None  # for run.json: completed, nothing_to_train, interrupted
    outcome_why: str | None = None  # why nothing_to_train


@dataclass(frozen=True)
class JobLost:
    """The last consumer went before end of stream with samples trained and not committed."""

    peer: str
    state: str
    reason: str
    trained: int
