"""docs/DESIGN.md "The life of a batch" (issues 32, 37): one real batch is followed from a
dataset row to the optimizer step that trains on it, through each role's own code in
process (a tiny real target, the broker's core without sockets, a tiny drafter), and every
type it takes on the way is recorded: at most five forms, one class named `Batch`, in the
order the section's `Forms:` line gives them. Every file and name of the section's steps
exists, at most 15 files, so the section cannot drift from the code."""

from __future__ import annotations

import importlib
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs
from transformers import AutoTokenizer

from tests.harness.core_rig import Rig, ledger_states, sent
from tests.harness.tiny import tiny_dir
from tests.producers.helpers import chat, write_jsonl
from dflash.broker.inbound import Arrival
from dflash.consumers.training import step
from dflash.consumers.training.config import TrainConfig
from dflash.consumers.training.train import train
from dflash.consumers.training.train_config import Hooks
from dflash.producers import producer as producer_module
from dflash.producers.chat import ChatEncoder
from dflash.producers.data import open_dataset
from dflash.producers.prefetch import Lease
from dflash.producers.producer import Producer
from dflash.producers.target import load_target
from dflash.protocol import codec
from dflash.protocol.batch import Batch
from dflash.runtime.target_heads import load_target_heads

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "DESIGN.md"
MOST_FILES = 15
MOST_FORMS = 5


def section(text: str) -> str:
    m = re.search(r"^## The life of a batch\n(.*?)(?=^## )", text, re.S | re.M)
    assert m, 'docs/DESIGN.md has no section "## The life of a batch"'
    return m.group(1)


def steps(text: str) -> list[tuple[str, list[str]]]:
    """The section's numbered steps: (file, names) from each step's head, the part before
    its " — " (the first backticked token is the file, the rest are names in it)."""
    out = []
    for line in section(text).splitlines():
        if not re.match(r"\d+\. ", line):
            continue
        head, sep, _ = line.partition(" — ")
        tokens = re.findall(r"`([^`]+)`", head)
        assert sep and tokens, f"a step reads `file` `name`, ... — what it does: {line!r}"
        out.append((tokens[0], tokens[1:]))
    return out


def forms_line(text: str) -> list[str]:
    """The section's `Forms:` line: the forms in the order a batch takes them."""
    m = re.search(r"^Forms: (.+)$", section(text), re.M)
    assert m, 'the life of a batch has no line "Forms: `Row` → ..."'
    return [f.strip().strip("`") for f in m.group(1).split("→")]


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
    assert files[0] == "producers/data.py" and files[-1] == "consumers/training/train.py", files
    assert all(names for _, names in found), "every step names what in its file does it"
    gone = [x for f, names in found for x in missing(f, names)]
    assert not gone, f"docs/DESIGN.md's life of a batch names what does not exist: {gone}"


def test_a_step_that_names_what_is_not_there_is_caught():
    text = ("## The life of a batch\n\nForms: `Row` → frames\n\n"
            "1. `producers/producer.py` `Producer.prepare`, `Producer.nothing` — x\n"
            "2. `consumers/nowhere.py` `f` — y\n\n## Next\n")
    found = steps(text)
    assert found == [("producers/producer.py", ["Producer.prepare", "Producer.nothing"]),
                     ("consumers/nowhere.py", ["f"])]
    assert [x for f, n in found for x in missing(f, n)] == ["producers/producer.py: Producer.nothing",
                                                            "consumers/nowhere.py"]
    assert forms_line(text) == ["Row", "frames"]


# ---------------------------------------------------------------- one real batch


def form(t: type) -> type | str:
    """The form a recorded type is: "frames" for the wire's list of frames, else the class.
    A subclass of `Batch` that adds only fields kept beside the wire's (`local`: the broker's
    bookkeeping of what it holds, broker/inbound.py) is the `Batch` it extends."""
    if t is list:
        return "frames"
    if issubclass(t, Batch) and t is not Batch:
        extra = [f for f in fields(t) if f.name not in {g.name for g in fields(Batch)}]
        if all(f.metadata.get("local") for f in extra):
            return Batch
    return t


def name(f: type | str) -> str:
    return f if isinstance(f, str) else f.__name__


class Trail:
    """The types one batch takes, in order, as (stage, type)."""

    def __init__(self):
        self.seen: list[tuple[str, type]] = []

    def __call__(self, stage: str, x):
        self.seen.append((stage, type(x)))
        return x

    def forms(self) -> list[type | str]:
        """The forms in order, a form taken at several stages in a row counted once."""
        out: list[type | str] = []
        for _, t in self.seen:
            f = form(t)
            if not out or out[-1] != f:
                out.append(f)
        return out


class OneLease:
    """The producer's work source: the lease the broker's core granted, then no more."""

    def __init__(self, grant: dict):
        self.leases = [Lease(grant["lease"], grant["epoch"], list(grant["samples"]))]
        self.done: dict[int, list] = {}

    def next_lease(self) -> Lease | None:
        return self.leases.pop() if self.leases else None

    def lease_done(self, lease: int, skipped: list) -> None:
        self.done[lease] = list(skipped)


def data_in(rig: Rig, frames: list) -> Batch:
    """A batch on the broker's data in, as broker/server.py `Broker._data` takes it: decoded
    once by the codec without making a tensor, then handed to the core without its frames
    (the server, here the rig, keeps those by batch ID). Returns what the core holds."""
    header = codec.unpack_header(frames[0])
    batch = codec.decode_batch(frames, run=rig.core.run_id, views=False, parsed=header)
    arrival = Arrival.read(batch, header, frames)
    rig.arrive(arrival, frames)
    return arrival.batch


@pytest.mark.usefixtures("_isolated_cache")  # the dataset's line index goes to a per-session folder
def test_a_real_batch_takes_the_forms_the_section_names(tmp_path, monkeypatch):
    trail = Trail()
    tiny = tiny_dir("qwen3", False)
    target = load_target(str(tiny), None, device=torch.device("cpu"))
    heads = load_target_heads(tiny, dtype=torch.float32)
    data = write_jsonl(tmp_path / "chats.jsonl", [chat(i) for i in range(8)])

    with Rig(tmp_path / "broker") as rig:  # the broker's core: 8 samples, leases of 4
        hello = {"layer_ids": target.layer_ids, "hidden_size": target.hidden_size,
                 "vocab_size": target.info.vocab_size, "dataset": {"n_samples": 8}}
        assert sent(rig.hello(b"prod", "producer", **hello), "welcome")
        grant = sent(rig.control(b"prod", "lease", want=4), "grant")[0].fields
        assert len(grant["samples"]) == 4

        # The producer, its own code end to end, each form it makes recorded on the way.
        dataset, encoder = open_dataset(data), ChatEncoder(AutoTokenizer.from_pretrained(tiny), 256)
        read, encode, pack = dataset.read, encoder.encode, producer_module.pack
        dataset.read = lambda s: trail("read", read(s))
        encoder.encode = lambda row: trail("encode", encode(row))
        monkeypatch.setattr(producer_module, "pack", lambda *a, **kw: [trail("pack", b) for b in pack(*a, **kw)])
        emitted: list[Batch] = []
        source = OneLease(grant)
        producer = Producer(target, dataset, encoder, source, lambda b: emitted.append(trail("emit", b)),
                            token_budget=4096, max_batch_size=8, name=rig.peer(b"prod").id)
        capture = producer.splitter.forward
        producer.splitter.forward = lambda b: capture(trail("capture", b))
        producer.run()
        (batch,) = emitted
        assert sorted(batch.samples) == sorted(grant["samples"]) and source.done == {grant["lease"]: []}

        # The wire and the broker: the producer link's frames, the core's intake and dispatch.
        frames = trail("send", codec.encode_batch(batch, rig.core.run_id))  # as ProducerLink.push_batch
        held = trail("broker", data_in(rig, frames))  # what the core holds (dispatch.py `Queued.batch`)
        assert rig.core.holds(batch.batch_id) and not held.frames and not held.tensors
        rig.control(b"prod", "done", lease=grant["lease"], skipped=[])
        rig.consumer(b"cons", credit=1)
        (relay,) = rig.dispatch()
        assert relay.batch_id == batch.batch_id
        relayed = [trail("relay", rig.frames[relay.batch_id])]
        assert relayed[0] is frames  # the very frames, relayed as they came

        # The consumer: its link reads the frames, the training loop stages and steps.
        read_batch = trail("link", codec.decode_batch(relayed[0], run=rig.core.run_id, peer="broker"))
        make_layout = step.make_layout

        def layout(b, *a, **kw):
            trail("step", b)
            return trail("layout", make_layout(b, *a, **kw))

        monkeypatch.setattr(step, "make_layout", layout)
        cfg = TrainConfig(draft_layers=1, target_layers=tuple(target.layer_ids), block_size=4, anchors=4,
                          mask_token_id=heads.spec.vocab_size - 1, log_position_every=0)
        acks = []

        def ack(step_: int, ids: list[str]) -> None:  # as BrokerHooks.on_step, straight to the core
            acks.append((step_, ids))
            rig.control(b"cons", "ack", batch_ids=ids, step=step_)

        with capture_logs():
            state = train(cfg, heads, iter([read_batch]), hooks=Hooks(on_step=ack))
        assert state.step == 1 and acks == [(1, [batch.batch_id])]
        assert ledger_states(rig.core).get("trained") == 4  # the core saw the step take each sample once

    stages = [s for s, _ in trail.seen]
    assert stages == ["read"] * 4 + ["encode"] * 4 + ["pack", "capture", "emit", "send", "broker", "relay", "link",
                                                      "step", "layout"], stages
    forms = trail.forms()
    distinct = list(dict.fromkeys(forms))
    assert len(distinct) <= MOST_FORMS, f"{len(distinct)} forms, at most {MOST_FORMS}: {trail.seen}"
    assert [f for f in distinct if name(f) == "Batch"] == [Batch], trail.seen
    assert [name(f) for f in forms] == forms_line(DESIGN.read_text()), trail.seen
