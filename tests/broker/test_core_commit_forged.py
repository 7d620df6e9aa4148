"""Who may commit (issue 36 item 1, PROTOCOL.md 4.5 "Who may send commit"), against
BrokerCore in-process: a commit moves what it names to `committed` for good, so one from a
producer, from a consumer that does not train the lineage, for a step beyond what its sender
acked, or naming no checkpoint of that step and lineage where the broker reads them, is
refused (`reject commit_refused`, broker.commit_refused) and commits nothing. The rank that
saves commits as before, an ack with no batch moving its step on. No sockets."""

from __future__ import annotations

import json
import struct
import threading

import pytest
from structlog.testing import capture_logs

from tests.broker.test_core_commits import one_batch_each
from tests.harness.core_rig import Rig, codes, sent

pytestmark = pytest.mark.unit


def checkpoint(folder, step: int, lineage: str, finished: bool = True):
    """A checkpoint folder as consumers/checkpoints/checkpoint.py leaves it, as far as the broker reads it:
    state.json's step, trained.safetensors' lineage, manifest.json (written last)."""
    folder.mkdir(parents=True)
    (folder / "state.json").write_text(json.dumps({"step": step}))
    header = json.dumps({"__metadata__": {"format": "dflash-trained", "lineage": lineage}}).encode()
    (folder / "trained.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    if finished:
        (folder / "manifest.json").write_text("{}")
    return str(folder)


def trained_on_a(r: Rig, steps: int = 2) -> list[str]:
    """Producer `prod`, consumer `c` started lineage A and acked one batch a step, steps 1..`steps`."""
    r.hello(b"prod", "producer")
    r.hello(b"c", "consumer")
    r.control(b"c", "lineage", lineage="A", step=0)
    ids = []
    for step in range(1, steps + 1):
        (bid,) = one_batch_each(r, b"prod", [b"c"])
        r.control(b"c", "ack", batch_ids=[bid], step=step, lineage="A")
        ids.append(bid)
    return ids


def refused(r: Rig, out, why: str, logs) -> str:
    """The reason of the one `commit_refused` in `out`; nothing committed; the log line says `why`."""
    assert codes(out) == ["commit_refused"], out
    assert r.core.ledger.counts["committed"] == 0 and r.core.ledger.last_commit is None
    assert [e["why"] for e in logs.events("broker.commit_refused")][-1] == why
    return sent(out, "reject")[0].fields["reason"]


@pytest.fixture
def logs():
    class Logs:
        def events(self, name):
            return [e for e in captured if e.get("event") == name]
    with capture_logs() as captured:
        yield Logs()


def test_a_producer_may_not_commit(tmp_path):
    with Rig(tmp_path / "run", lease_size=2) as r:
        trained_on_a(r)
        out = r.control(b"prod", "commit", step=2, checkpoint="/x", lineage="A")
        assert codes(out) == ["bad_message"] and "not accepted from a producer" in sent(out, "reject")[0].fields["reason"]
        assert r.core.ledger.counts["committed"] == 0


def test_a_session_that_does_not_train_the_lineage_may_not_commit_it(tmp_path, logs):
    with Rig(tmp_path / "run", lease_size=2) as r:
        trained_on_a(r)
        r.hello(b"forger", "consumer")  # copies the lineage from the heartbeat
        reason = refused(r, r.control(b"forger", "commit", step=2, checkpoint="/x", lineage="A"),
                         "not_lineage_consumer", logs)
        assert "neither started that lineage nor acked" in reason
        # an ack naming no batch it was sent does not make it one of the lineage's consumers
        r.control(b"forger", "ack", batch_ids=[], step=1_000_000, lineage="A")
        r.control(b"forger", "ack", batch_ids=["p1-0"], step=1_000_000, lineage="A")
        refused(r, r.control(b"forger", "commit", step=1_000_000, checkpoint="/x", lineage="A"),
                "not_lineage_consumer", logs)
        assert sent(r.control(b"c", "commit", step=2, checkpoint="/ckpt/A2", lineage="A"), "reject") == []
        assert r.core.ledger.counts["committed"] == 2


def test_a_commit_beyond_the_step_its_sender_acked_is_refused(tmp_path, logs):
    with Rig(tmp_path / "run", lease_size=2) as r:
        trained_on_a(r)
        reason = refused(r, r.control(b"c", "commit", step=1_000_000, checkpoint="/x", lineage="A"),
                         "ahead_of_acks", logs)
        assert "acked lineage 'A' up to step 2 only" in reason
        # a second rank that announced the lineage again may commit no further than its start
        r.hello(b"r1", "consumer")
        r.control(b"r1", "lineage", lineage="A", step=50)  # what the message says of the step is ignored
        refused(r, r.control(b"r1", "commit", step=1, checkpoint="/x", lineage="A"), "ahead_of_acks", logs)
        # a rank with no batch at the step it saves acks that step with none, then commits it
        r.control(b"c", "ack", batch_ids=[], step=3, lineage="A")
        assert sent(r.control(b"c", "commit", step=3, checkpoint="/ckpt/A3", lineage="A"), "reject") == []
        assert r.core.ledger.counts["committed"] == 2 and r.core.ledger.last_commit == (3, "/ckpt/A3")


def test_a_commit_must_name_a_checkpoint_of_its_step_and_lineage_once_the_broker_reads_them(tmp_path, logs):
    with Rig(tmp_path / "run", lease_size=2) as r:
        trained_on_a(r, steps=3)
        ck = tmp_path / "ckpts"
        unfinished = checkpoint(ck / "step-1-tmp", 1, "A", finished=False)
        refused(r, r.control(b"c", "commit", step=1, checkpoint=unfinished, lineage="A"), "not_a_checkpoint", logs)
        other_step = checkpoint(ck / "step-1", 1, "A")
        reason = refused(r, r.control(b"c", "commit", step=2, checkpoint=other_step, lineage="A"),
                         "not_a_checkpoint", logs)
        assert "checkpoint of step 1, not 2" in reason
        other_lineage = checkpoint(ck / "B-2", 2, "B")
        refused(r, r.control(b"c", "commit", step=2, checkpoint=other_lineage, lineage="A"), "not_a_checkpoint", logs)
        assert not r.core.commits.shared_disk  # nothing read yet: a path not here may be on another host
        good = checkpoint(ck / "step-2", 2, "A")
        assert sent(r.control(b"c", "commit", step=2, checkpoint=good, lineage="A"), "reject") == []
        assert r.core.commits.shared_disk and r.core.ledger.counts["committed"] == 2
        # the broker reads this run's checkpoints now: a path it lacks is no checkpoint
        r.advance(1.0)  # past the replies' rate limit (3 a second per peer)
        out = r.control(b"c", "commit", step=3, checkpoint=str(ck / "step-3"), lineage="A")
        assert codes(out) == ["commit_refused"] and r.core.ledger.last_commit == (2, good)
        assert [e["why"] for e in logs.events("broker.commit_refused")][-1] == "no_checkpoint"
        assert "does not exist on the broker's filesystem" in sent(out, "reject")[0].fields["reason"]
        r.advance(1.0)
        out = r.control(b"c", "commit", step=3, checkpoint="/" + "a" * 5000, lineage="A")  # too long to stat
        assert codes(out) == ["commit_refused"] and r.core.ledger.last_commit == (2, good)


def test_where_the_checkpoints_are_not_readable_a_commit_is_checked_by_its_session_and_step(tmp_path):
    with Rig(tmp_path / "run", lease_size=2) as r:
        trained_on_a(r)
        assert sent(r.control(b"c", "commit", step=2, checkpoint="/on/another/host/step-2", lineage="A"),
                    "reject") == []
        assert r.core.ledger.counts["committed"] == 2 and not r.core.commits.shared_disk


class CoreLink:
    """The consumer's link as the hooks use it, wired to the rig's core as session `identity`."""

    def __init__(self, rig: Rig, identity: bytes):
        self.rig, self.identity, self.out = rig, identity, []
        self.stopped, self.broker_stats = threading.Event(), {}

    def send_control(self, msg) -> None:
        self.out += self.rig.control(self.identity, msg.type, **msg.fields())

    def ack(self, batch_ids, step, lineage) -> None:
        self.out += self.rig.control(self.identity, "ack", batch_ids=batch_ids, step=step, lineage=lineage)

    def commit(self, step, path, lineage) -> None:
        self.out += self.rig.control(self.identity, "commit", step=step, checkpoint=path, lineage=lineage)


def test_a_replica_healed_into_the_lineage_commits_a_step_it_trained_no_batch_of(tmp_path, logs):
    # An elastic group's new rank 0, healed from a live replica, saved the run's last step with no batch of its
    # own left: its commit was refused and the consumer failed (test_elastic under .ci/run, 2026-12-08). The
    # consumer's own hooks, against the core.
    import torch

    from dflash.consumers.checkpoints.record import TrainedRecord
    from dflash.consumers.process.broker_hooks import BrokerHooks

    with Rig(tmp_path / "run", lease_size=2) as r:
        trained_on_a(r)
        r.hello(b"h", "consumer")
        link = CoreLink(r, b"h")
        hooks = BrokerHooks(link, 0, link.stopped, torch.device("cpu"))
        healed = TrainedRecord.from_state({"complete": False, "repeats": 0, "lineage": "A", "parent": None,
                                           "parent_step": 0, "epochs": {}})
        assert healed.origin == "healed"
        hooks.on_lineage(healed)
        path = checkpoint(tmp_path / "ckpts" / "step-2", 2, "A")
        hooks.on_checkpoint(2, path)
        assert codes(link.out) == [] and not logs.events("broker.commit_refused"), link.out
        assert r.core.ledger.last_commit == (2, path) and r.core.ledger.counts["committed"] == 2
