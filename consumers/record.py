"""What the drafter's weights have been trained on: (epoch, sample) -> how many times.

The broker's ledger says what it *believes* was trained and committed; this record is
what the training loop actually consumed, kept by the loop itself. Every step, every rank's
(epoch, sample) pairs are all-gathered (a few small ints per rank) and counted on every
rank, so all ranks hold the same record; rank 0 writes it into each checkpoint, next to
the weights it describes, and a resume carries it on. It is cumulative over the whole
chain of resumed runs, so the final checkpoint's record says, for every (epoch, sample),
how often the weights saw it: 1 everywhere is exactly-once.

File `trained.safetensors` in the checkpoint folder (read with `safetensors.numpy`, no
torch needed):
  tensors   `epoch.<E>`: uint8 [n], n = 1 + the highest sample ID seen in epoch E;
            element s = times sample s of epoch E was trained (saturates at 255)
  metadata  `format`: "dflash-trained-v1"; `complete`: "1", or "0" when the chain started
            from a checkpoint without a record (the weights hold samples it does not
            list); `repeats`: samples trained more than once (sum of count-1 over count>1)
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np

FILE = "trained.safetensors"
FORMAT = "dflash-trained-v1"


class TrainedRecord:
    def __init__(self, complete: bool = True):
        self.epochs: dict[int, bytearray] = {}
        self.complete = complete
        self.repeats = 0

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
        """(epoch, sample) pairs trained at least once."""
        return sum(len(c) - c.count(0) for c in self.epochs.values())

    def counts(self, epoch: int) -> np.ndarray:
        """uint8 counts of `epoch`, trimmed after the highest sample seen."""
        c = np.frombuffer(bytes(self.epochs.get(epoch, b"")), dtype=np.uint8)
        nz = np.flatnonzero(c)
        return c[: nz[-1] + 1] if nz.size else c[:0]

    def to_state(self) -> dict:
        """The record as plain values and uint8 tensors (sent to a joining replica)."""
        import torch

        return {"complete": self.complete, "repeats": self.repeats,
                "epochs": {e: torch.from_numpy(self.counts(e).copy()) for e in self.epochs}}

    @classmethod
    def from_state(cls, state: dict) -> "TrainedRecord":
        rec = cls(complete=bool(state["complete"]))
        rec.repeats = int(state["repeats"])
        rec.epochs = {int(e): bytearray(t.numpy().astype(np.uint8).tobytes()) for e, t in state["epochs"].items()}
        return rec

    def save(self, folder: Path) -> Path:
        from safetensors.numpy import save_file

        tensors = {f"epoch.{e}": self.counts(e).copy() for e in sorted(self.epochs)}
        path = Path(folder) / FILE
        save_file(tensors, path, metadata={"format": FORMAT, "complete": "1" if self.complete else "0",
                                           "repeats": str(self.repeats)})
        return path

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
            for name in f.keys():
                rec.epochs[int(name.split(".", 1)[1])] = bytearray(f.get_tensor(name).astype(np.uint8).tobytes())
        return rec
