"""The run's facts: its target and dataset, fixed by the first producer that states them
(PROTOCOL.md 4.1) or inherited on resume. `RunFacts` judges peers against them and records changes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

from dflash.protocol.messages import DatasetFacts
from dflash.protocol.target_id import describe_target, same_target
from dflash.runtime.logs import get_logger

from . import runinfo
from .leases import LeasePool
from .ledger import Ledger
from .peers import ConsumerSession
from .statements import ConsumerStatement, ProducerStatement

log = get_logger()

FACT_KEYS = ("target", "layer_ids", "hidden_size")  # a later producer must state these as the run has them
# kept once known: target_id checked by target_mismatch, vocab_size by intake's token ID check
KEPT_KEYS = ("target_id", "vocab_size")
COUNT_KEYS = ("hidden_size", "vocab_size")  # facts that must be positive counts when stated


@dataclass(frozen=True)
class Facts:
    """What the run knows of its target and dataset, as sent; None where nobody stated it yet."""

    dataset: DatasetFacts | None = None
    target: object = None
    layer_ids: object = None
    hidden_size: object = None
    target_id: object = None
    vocab_size: object = None

    def as_dict(self) -> dict:
        """The known facts as run.json, the ledger's meta and the status map show them."""
        out: dict = {}
        if self.dataset is not None:
            out["dataset"] = {"n_samples": self.dataset.n_samples, "fingerprint": self.dataset.fingerprint}
        out.update({f.name: getattr(self, f.name) for f in fields(self)
                    if f.name != "dataset" and getattr(self, f.name) is not None})
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Facts:
        """Facts as as_dict wrote them (a parent run's run.json); other keys are ignored."""
        ds = d.get("dataset")
        dataset = DatasetFacts(ds["n_samples"], ds.get("fingerprint")) if isinstance(ds, dict) else None
        return cls(dataset, *(d.get(f.name) for f in fields(cls) if f.name != "dataset"))

    def with_producer(self, said: ProducerStatement) -> Facts | str:
        """These facts with the producer's statement added, or why it does not fit the run."""
        n, fp = said.n_samples, said.fingerprint
        if n is not None and not _count(n, 0):
            return f"config.dataset.n_samples {n!r} is not a count"
        known = self.dataset
        if known is None and n is None:
            return "the first producer must send config.dataset.n_samples (or start the broker with --num-samples)"
        if known is not None:
            if n is not None and n != known.n_samples:
                return f"dataset has {n} samples; this run's has {known.n_samples}"
            if fp is not None and known.fingerprint not in (None, fp):
                return f"dataset fingerprint {fp!r} differs from this run's {known.fingerprint!r}"
        for k in COUNT_KEYS:
            v = getattr(said, k)
            if v is not None and not _count(v, 1):
                return f"config.{k} {v!r} is not a positive count"
        for k in FACT_KEYS:
            if getattr(self, k) is not None and getattr(said, k) != getattr(self, k):
                return f"{k} {getattr(said, k)!r} differs from this run's {getattr(self, k)!r}"
        if self.vocab_size is not None and said.vocab_size is not None and said.vocab_size != self.vocab_size:
            return f"vocab_size {said.vocab_size!r} differs from this run's {self.vocab_size!r}"
        new = replace(self, **{k: getattr(said, k) for k in FACT_KEYS + KEPT_KEYS
                               if getattr(self, k) is None and getattr(said, k) is not None})
        if known is None:
            new = replace(new, dataset=DatasetFacts(n, fp))
        elif known.fingerprint is None and fp is not None:
            new = replace(new, dataset=DatasetFacts(known.n_samples, fp))
        return new

    def heartbeat(self) -> dict:
        """The facts a consumer that joined before any producer waits for (PROTOCOL.md 4.2)."""
        return {"layer_ids": self.layer_ids, "hidden_size": self.hidden_size, "target_id": self.target_id}


def _count(v, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


class RunFacts:
    """The core's part for the run's facts: `facts` holds them."""

    def __init__(self, facts: Facts, ledger: Ledger, run_dir: Path, pool: LeasePool):
        self.facts, self.ledger, self.run_dir, self.pool = facts, ledger, run_dir, pool

    def target_mismatch(self, said: ProducerStatement | ConsumerStatement, consumers: list[ConsumerSession]) -> str | None:
        """Why this peer's target is not the run's, or None; before any producer, against live consumers'."""
        if isinstance(said, ProducerStatement):
            role, mine = "producer", said.target_id
            if self.facts.target_id is not None:
                theirs, whose = self.facts.target_id, "this run's target (its first producer's)"
            else:
                other = next((c for c in consumers if c.said.target is not None and mine is not None
                              and not same_target(c.said.target, mine)), None)
                if other is None:
                    return None
                theirs, whose = other.said.target, f"live consumer {other.id}'s target"
        else:
            role, mine, theirs = "consumer", said.target, self.facts.target_id
            whose = "this run's target (its producers')"
            if theirs is None or mine is None:
                return None
        if same_target(mine, theirs):
            return None
        return (f"this {role}'s --target is {describe_target(mine)}, {whose} is {describe_target(theirs)}: every "
                "producer and consumer of a run must load the same target model")

    def fix(self, facts: Facts, peer_id: str) -> None:
        """The run's facts are now `facts` (a producer joined): recorded where they are kept."""
        if facts == self.facts:
            return
        self.facts = facts
        if not self.pool.known:
            self.pool.set_dataset(facts.dataset.n_samples)
        d = facts.as_dict()
        self.ledger.set_meta(facts=d)
        runinfo.update(self.run_dir, facts=d)
        log.info("broker.run_facts", peer=peer_id, **d)
