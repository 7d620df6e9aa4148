"""What the drafter's weights have been trained on: (epoch, sample) -> how many times.

The broker's ledger says what it *believes* was trained; this record is what the loop actually
consumed, the same on every rank, checkpointed with the weights and cumulative over resumes:
1 everywhere is exactly-once.

File `trained.safetensors` in the checkpoint folder (read with `safetensors.numpy`, no
torch needed):
  tensors   `epoch.<E>`: uint8 [n], n = 1 + the highest sample ID seen in epoch E;
            element s = times sample s of epoch E was trained (saturates at 255)
  metadata  `format`: "dflash-trained-v1"; `complete`: "1", or "0" when the chain started
            from a checkpoint without a record (the weights hold samples it does not
            list); `repeats`: samples trained more than once (sum of count-1 over count>1);
            `lineage`, `parent`, `parent_step`: the lineage of these weights (below)

Lineage (PROTOCOL.md 4.5): a name for one history of these weights, sent with every ack and
commit so the broker commits only samples the committing weights hold."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import Iterable

import numpy as np

from dflash.protocol.messages import LineageStart

FILE = "trained.safetensors"
FORMAT = "dflash-trained-v1"


class TrainedRecord:
    def __init__(self, complete: bool = True):
        self.epochs: dict[int, bytearray] = {}
        self.complete = complete
        self.repeats = 0
        self.lineage = uuid.uuid4().hex[:16]  # fresh weights: a lineage of their own
        self.parent: str | None = None  # the lineage these weights continue, and from which step
        self.parent_step = 0
        self.origin = "fresh"  # fresh | checkpoint | healed

    def fork(self, previous: str, step: int) -> None:
        """Go on as a new lineage after loading a checkpoint, named from `previous`, so replicas that
        shared one and loaded the same checkpoint share the new one too."""
        self.parent, self.parent_step = self.lineage, step
        self.lineage = hashlib.sha256(f"{previous}/{self.lineage}/{step}".encode()).hexdigest()[:16]
        self.origin = "checkpoint"

    def lineage_message(self, checkpoint: str | None) -> LineageStart:
        return LineageStart(self.lineage, self.parent_step, parent=self.parent, checkpoint=checkpoint)

    def holds(self, epoch: int, sample: int) -> bool:
        counts = self.epochs.get(epoch)
        return counts is not None and 0 <= sample < len(counts) and counts[sample] > 0

    def add(self, pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """Count one training of each (epoch, sample); return those seen before (repeats)."""
        again = []
        for epoch, sample in pairs:
            counts = self.epochs.setdefault(epoch, bytearray())
            if sample >= len(counts):  # grow by doubling: sample IDs arrive shuffled
                counts.extend(bytes(max(sample + 1, 2 * len(counts)) - len(counts)))
            if counts[sample]:
                again.append((epoch, sample))
            counts[sample] = min(255, counts[sample] + 1)
        self.repeats += len(again)
        return again

    def count(self) -> int:
        return sum(len(c) - c.count(0) for c in self.epochs.values())

    def counts(self, epoch: int) -> np.ndarray:
        c = np.frombuffer(bytes(self.epochs.get(epoch, b"")), dtype=np.uint8)
        nz = np.flatnonzero(c)
        return c[: nz[-1] + 1] if nz.size else c[:0]

    def to_state(self) -> dict:
        """The record as plain values and uint8 tensors (sent to a joining replica)."""
        import torch

        return {"complete": self.complete, "repeats": self.repeats, "lineage": self.lineage, "parent": self.parent,
                "parent_step": self.parent_step,
                "epochs": {e: torch.from_numpy(self.counts(e).copy()) for e in self.epochs}}

    @classmethod
    def from_state(cls, state: dict) -> "TrainedRecord":
        rec = cls(complete=bool(state["complete"]))
        rec.repeats = int(state["repeats"])
        if state.get("lineage"):  # a healthy replica's lineage: the same weights
            rec.lineage, rec.parent, rec.parent_step = str(state["lineage"]), state.get("parent"), \
                int(state.get("parent_step") or 0)
        rec.origin = "healed"
        rec.epochs = {int(e): bytearray(t.numpy().astype(np.uint8).tobytes()) for e, t in state["epochs"].items()}
        return rec

    def save(self, folder: Path) -> Path:
        return save_record(self.to_state(), folder)

    @classmethod
    def load(cls, folder: Path) -> "TrainedRecord | None":
        """The record of a checkpoint folder, or None if it has none (older checkpoints)."""
        from safetensors import safe_open

        path = Path(folder) / FILE
        if not path.is_file():
            return None
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT}")
            rec = cls(complete=meta.get("complete") == "1")
            rec.repeats = int(meta.get("repeats", 0))
            if meta.get("lineage"):  # older records have none: a lineage of their own
                rec.lineage = meta["lineage"]
                rec.parent, rec.parent_step = meta.get("parent") or None, int(meta.get("parent_step") or 0)
            for name in f.keys():
                rec.epochs[int(name.split(".", 1)[1])] = bytearray(f.get_tensor(name).astype(np.uint8).tobytes())
        return rec


def save_record(state: dict, folder: Path) -> Path:
    """Write a record's `to_state()` as `trained.safetensors` in `folder` (the format above)."""
    from safetensors.numpy import save_file

    tensors = {f"epoch.{e}": state["epochs"][e].numpy() for e in sorted(state["epochs"])}
    path = Path(folder) / FILE
    save_file(tensors, path, metadata={"format": FORMAT, "complete": "1" if state["complete"] else "0",
                                       "repeats": str(state["repeats"]), "lineage": state["lineage"],
                                       "parent": state["parent"] or "", "parent_step": str(state["parent_step"])})
    return path
