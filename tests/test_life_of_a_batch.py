"""docs/DESIGN.md "The life of a batch" (issue 32): at most 15 files from `dflash-produce`
reading a row to the optimizer step, and every file and name it gives exists, so the
section cannot drift from the code. And the batch is one type on the way: what the
producer builds, what the broker holds and what the consumer's link reads are the wire's
`Batch`."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

from dflash.broker.dispatch import Queued
from dflash.broker.inbound import Batch as BrokerBatch
from dflash.consumers.training.batch import Batch as DeviceBatch
from dflash.protocol import codec
from dflash.protocol.messages import DATA, Batch

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "DESIGN.md"
MOST_FILES = 15
RUN = "20261204T000000Z-life"


def steps(text: str) -> list[tuple[str, list[str]]]:
    """The section's numbered steps: (file, names) from each step's head, the part before
    its " — " (the first backticked token is the file, the rest are names in it)."""
    m = re.search(r"^## The life of a batch\n(.*?)(?=^## )", text, re.S | re.M)
    assert m, 'docs/DESIGN.md has no section "## The life of a batch"'
    out = []
    for line in m.group(1).splitlines():
        if not re.match(r"\d+\. ", line):
            continue
        head, sep, _ = line.partition(" — ")
        tokens = re.findall(r"`([^`]+)`", head)
        assert sep and tokens, f"a step reads `file` `name`, ... — what it does: {line!r}"
        out.append((tokens[0], tokens[1:]))
    return out


def missing(file: str, names: list[str]) -> list[str]:
    """What of `file` and its `names` (`func`, `Class`, `Class.method`) does not exist."""
    path = ROOT / file
    if not path.is_file():
        return [file]
    module = importlib.import_module("dflash." + file.removesuffix(".py").replace("/", "."))
    gone = []
    for name in names:
        obj = module
        for part in name.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                gone.append(f"{file}: {name}")
                break
    return gone


def test_the_life_of_a_batch_names_at_most_15_files_that_all_exist():
    found = steps(DESIGN.read_text())
    files = [f for f, _ in found]
    assert len(set(files)) == len(files), f"a file named twice: {files}"
    assert 0 < len(files) <= MOST_FILES, f"{len(files)} files, at most {MOST_FILES}: {files}"
    assert files[0].startswith("producers/") and files[-1] == "consumers/training/train.py", files
    assert all(names for _, names in found), "every step names what in its file does it"
    gone = [x for f, names in found for x in missing(f, names)]
    assert not gone, f"docs/DESIGN.md's life of a batch names what does not exist: {gone}"


def test_a_step_that_names_what_is_not_there_is_caught():
    text = ("## The life of a batch\n\n1. `producers/producer.py` `Producer.prepare`, `Producer.nothing` — x\n"
            "2. `consumers/nowhere.py` `f` — y\n\n## Next\n")
    found = steps(text)
    assert found == [("producers/producer.py", ["Producer.prepare", "Producer.nothing"]),
                     ("consumers/nowhere.py", ["f"])]
    assert [x for f, n in found for x in missing(f, n)] == ["producers/producer.py: Producer.nothing",
                                                            "consumers/nowhere.py"]


def test_the_batch_is_one_type_from_the_producer_to_the_consumers_link():
    """Built (form 1), framed (form 2), held by the broker and read by a consumer's link as
    the same `Batch`, then the consumer's own tensors (form 3)."""
    T = 5
    built = Batch("p1-0", "p1", 3, 0, [7], [T], [1, 2], tensors={
        "input_ids": torch.arange(T, dtype=torch.int32), "loss_mask": torch.ones(T, dtype=torch.uint8),
        "hidden": torch.randn(T, 8).to(torch.bfloat16)})
    frames = [bytes(f) for f in codec.encode(built.to_header(RUN), built.tensors)]

    msg = codec.decode(frames, allowed=DATA, run=RUN, views=False)  # as broker/server.py reads data in
    held = BrokerBatch.from_header(msg.header, frames=frames)
    assert isinstance(held, Batch) and held.fields() == built.fields() and not held.tensors
    assert Queued(held, 0, 0.0).batch is held  # the bookkeeping beside it, not a copy of it

    read = codec.decode_batch(frames, run=RUN)  # as the consumer's link reads it
    assert type(read) is Batch and read.fields() == built.fields()
    assert all(torch.equal(read.tensors[k], t) for k, t in built.tensors.items())

    trained = DeviceBatch.from_message(read, torch.float32)
    assert trained.batch_id == "p1-0" and trained.samples == [7] and torch.equal(trained.input_ids, read.tensors["input_ids"])
    assert trained.hidden.dtype == torch.float32
