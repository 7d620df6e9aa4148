"""A poison batch cannot block a run (issue 29, item 2). A real broker, real `dflash-produce`
and `dflash-consume` processes on a tiny target, and a lying client (a hand-written
producer, tests/harness/fakes.py) that sends batches of the wrong hidden width, or with
token IDs outside the vocabulary:

- when the run's facts say what fits (a producer stated hidden_size and vocab_size), the
  broker refuses the batch at intake, naming the producer, and ends the liar's session;
- when nobody had stated them, consumers fail on it: each commits what it trained, says
  which batch and why (`failed`) and exits 2; after two, the batch is quarantined and its
  samples are made again by the real producer.

Either way the run finishes with every sample committed exactly once, and the bad samples
are reported by reason and count (status map, run.json, ledger)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack
import pytest

from tests.harness.broker import BrokerProc
from tests.harness.fakes import FakeProducer, Rejected
from tests.harness.ledger import committed
from tests.harness.wait import wait_for

pytestmark = pytest.mark.integration

N = 6  # samples in the data file
LAYERS = [1, 3]


@pytest.fixture(scope="module")
def target():
    from dflash.tools.tiny import tiny_target

    return tiny_target()


@pytest.fixture(scope="module")
def facts(target) -> dict:
    cfg = json.loads((Path(target) / "config.json").read_text())
    return {"hidden_size": cfg["hidden_size"], "vocab_size": cfg["vocab_size"]}


@pytest.fixture
def data(tmp_path) -> Path:
    import dflash.producers.sample_data as sample_data

    rows = (Path(sample_data.__file__).parent / "chats.jsonl").read_text().splitlines()[:N]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(OMP_NUM_THREADS="1", DFLASH_LOG_JSON="1")
    return env


def consumer(b: BrokerProc, target, out: Path) -> subprocess.Popen:
    from transformers import AutoTokenizer

    from dflash.tools.tiny import MASK_TOKEN

    mask = AutoTokenizer.from_pretrained(target).convert_tokens_to_ids(MASK_TOKEN)
    with open(out, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "dflash.consumers.process.consume_command", "--broker", b.control, "--target",
                                 str(target), "--runs-dir", str(b.runs_dir), "--instance", out.stem, "--draft-layers",
                                 "1", "--block-size", "4", "--anchors", "6", "--mask-token-id", str(mask)],
                                stdout=f, stderr=subprocess.STDOUT, env=_env())


def producer(b: BrokerProc, target, data: Path, out: Path) -> subprocess.Popen:
    with open(out, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "dflash.producers.produce_command", "--broker", b.control, "--runs-dir",
                                 str(b.runs_dir), "--instance", "real-p", "--device", "cpu", "--target", str(target),
                                 "--data", str(data), "--target-layers", ",".join(map(str, LAYERS)),
                                 "--token-budget", "512", "--max-length", "256", "--max-batch-size", "2",
                                 "--prefetch", "1"], stdout=f, stderr=subprocess.STDOUT, env=_env())


def waited(p: subprocess.Popen, out: Path, timeout_s: float = 240) -> int:
    try:
        return p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"{out.name} did not end: {out.read_text()[-2000:]}") from None


def frames(liar: FakeProducer, lease: int, epoch: int, samples: list[int], *, width: int, id_base: int = 0):
    """A batch of `samples` (8 tokens each, loss on all): token IDs id_base + sample, zero features."""
    T = 8 * len(samples)
    liar.seq += 1
    h = {"v": 1, "type": "batch", "run": liar.run, "batch_id": f"{liar.peer}-{liar.seq}", "producer": liar.peer,
         "lease": lease, "epoch": epoch, "samples": samples, "seq_lens": [8] * len(samples), "layer_ids": LAYERS,
         "tensors": [{"name": "input_ids", "dtype": "int32", "shape": [T]},
                     {"name": "loss_mask", "dtype": "uint8", "shape": [T]},
                     {"name": "hidden", "dtype": "bfloat16", "shape": [T, width]}]}
    ids = array("i", [id_base + 10 + s for s in samples for _ in range(8)]).tobytes()
    return h["batch_id"], [msgpack.packb(h), ids, b"\x01" * T, bytes(2 * T * width)]


def poison(liar: FakeProducer, g: dict, form: str, facts: dict, samples: list[int]) -> tuple[str, list]:
    good = len(LAYERS) * facts["hidden_size"]
    if form == "hidden_width":
        return frames(liar, g["lease"], g["epoch"], samples, width=good + len(LAYERS) * 8)
    return frames(liar, g["lease"], g["epoch"], samples, width=good, id_base=facts["vocab_size"])


def bad_rows(run_dir: Path) -> list[tuple]:
    db = sqlite3.connect(run_dir / "ledger.sqlite")
    try:
        return db.execute("SELECT action, fault, n_samples, remade, set_aside FROM bad_batches").fetchall()
    finally:
        db.close()


def stop(b: BrokerProc) -> None:
    """SIGTERM, and a kill if it does not end (a failed test may leave it draining)."""
    try:
        b.stop(10)
    except subprocess.TimeoutExpired:
        b.proc.kill()
        b.proc.wait(10)


@contextmanager
def broker_and_peers(tmp_path: Path) -> Iterator[tuple[BrokerProc, list]]:
    """A broker, and a list for the (process, output) pairs the test starts: every one of
    them ended on the way out, however the test ends."""
    b = BrokerProc(tmp_path / "runs", ["--timeout-s", "30"])
    procs: list = []
    try:
        yield b, procs
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
        stop(b)


def finished(b: BrokerProc) -> dict:
    assert b.proc.wait(60) == 0, b.stderr[-5:]
    info = json.loads((b.run_dir / "run.json").read_text())
    assert info["outcome"] == "completed", info
    assert sorted(s for _, s in committed(b.run_dir)) == list(range(N))  # every sample, once
    return info


def real_peers_finish(b: BrokerProc, target, data: Path, tmp_path: Path, consumer_name: str, procs: list) -> dict:
    """A real producer and consumer make and train the rest: the run finishes, every sample
    once. `procs` gets them, for the caller's clean-up."""
    procs += [(producer(b, target, data, tmp_path / "p.out"), tmp_path / "p.out"),
              (consumer(b, target, tmp_path / f"{consumer_name}.out"), tmp_path / f"{consumer_name}.out")]
    for p, out in procs:
        assert waited(p, out) == 0, out.read_text()[-2000:]
    return finished(b)


FORMS = ("hidden_width", "token_ids")


@pytest.mark.timeout(600)
def test_poison_batches_the_broker_can_check_are_refused_naming_their_producer(tmp_path, target, facts, data):
    with broker_and_peers(tmp_path) as (b, procs):
        # Two liars join first, stating the run's facts as a real producer would; one lies in each form
        liars = {form: FakeProducer(b.control, f"liar-{form}", name_connection=True, config={
            "target": str(target), "layer_ids": LAYERS, **facts, "dataset": {"n_samples": N}}) for form in FORMS}
        for form, liar in liars.items():
            liar.send("lease", want=2)
            g = liar.wait_for({"grant"}, 10)
            assert len(g["samples"]) == 2
            bid, bad = poison(liar, g, form, facts, g["samples"])
            liar.push(bad)
            with pytest.raises(Rejected, match=f"bad_batch: batch {bid} does not fit"):
                liar.wait_for({"nothing"}, 10)
            ev = b.wait_event("broker.batch_rejected", pred=lambda e, p=liar.peer: e["peer"] == p)
            assert ev["fault"] == form and ev["peer_instance"] == f"liar-{form}", ev
            assert ev["own_connection"] is True and ev["samples"] == 2
            lost = b.wait_event("broker.peer_lost", pred=lambda e, p=liar.peer: e["peer"] == p)
            assert lost["held"]["samples_returned"] == 2  # its lease goes back to the pool
            liar.close()

        info = real_peers_finish(b, target, data, tmp_path, "c1", procs)
    assert info["bad_batches"] == {"rejected": {form: {"batches": 1, "samples": 2} for form in FORMS}}
    assert sorted(bad_rows(b.run_dir)) == [("rejected", form, 2, 0, 0) for form in FORMS]
    assert not info["samples"].get("quarantined")


@pytest.mark.timeout(900)
def test_poison_batches_consumers_fail_on_are_quarantined_and_the_run_finishes(tmp_path, target, facts, data):
    with broker_and_peers(tmp_path) as (b, procs):
        # A client that states no hidden_size or vocab_size: the broker cannot check its batches
        liar = FakeProducer(b.control, "liar", name_connection=True, config={
            "target": str(target), "layer_ids": LAYERS, "dataset": {"n_samples": N}})
        liar.send("lease", want=5)
        g = liar.wait_for({"grant"}, 10)
        s = g["samples"]
        width = len(LAYERS) * facts["hidden_size"]
        for batch in (frames(liar, g["lease"], g["epoch"], s[:1], width=width),  # trained first
                      poison(liar, g, FORMS[0], facts, s[1:2]), poison(liar, g, FORMS[1], facts, s[2:3]),
                      frames(liar, g["lease"], g["epoch"], s[3:], width=width)):
            liar.push(batch[1])
        wait_for(b.ask, lambda st: st["samples"]["produced"] == 5, 20)
        liar.send("done", lease=g["lease"], skipped=[])
        liar.send("bye", reason="done")
        liar.close()

        # Each consumer fails on the poison batch at the front of the queue, says so and exits 2;
        # the second to fail on one quarantines it
        for i, form, failures in ((1, FORMS[0], 1), (2, FORMS[0], 2), (3, FORMS[1], 1), (4, FORMS[1], 2)):
            out = tmp_path / f"c{i}.out"
            assert waited(consumer(b, target, out), out) == 2, out.read_text()[-2000:]
            ev = b.wait_event("broker.peer_failed", pred=lambda e, n=f"c{i}": e["peer_instance"] == n)
            assert ev["code"] == "bad_batch" and ev["fault"] == form and ev["batch_held"] is True, ev
            assert ev["batch_failures"] == failures and ev["quarantined"] is (failures == 2)
        # the first trained the good batch before and committed it on its way out: the job goes on
        assert [e["peer"] for e in b.events("broker.commit")] == ["c1"] and not b.events("broker.job_lost")
        quarantined = b.events("broker.batch_quarantined")
        assert [(q["fault"], q["samples"], q["remade"], q["set_aside"], q["consumers"]) for q in quarantined] == [
            (FORMS[0], 1, 1, 0, ["c1", "c2"]), (FORMS[1], 1, 1, 0, ["c3", "c4"])]

        # The real producer makes the rest, and the poisoned samples again; a fifth consumer trains it all
        info = real_peers_finish(b, target, data, tmp_path, "c5", procs)
    assert info["bad_batches"] == {"quarantined": {
        form: {"batches": 1, "samples": 1, "remade": 1, "set_aside": 0} for form in FORMS}}
    assert sorted(bad_rows(b.run_dir)) == [("quarantined", form, 1, 1, 0) for form in FORMS]
    assert not info["samples"].get("quarantined")
    r = subprocess.run([sys.executable, "-m", "dflash.tools.status_command", "--run", b.run_id, "--runs-dir",
                        str(b.runs_dir), "--timeout-s", "0.2"], capture_output=True, text=True, timeout=60)
    assert "FINISHED" in r.stdout and all(
        f"quarantined 1 batch (1 sample: 1 made again, 0 set aside) after consumers failed on it: {form}" in r.stdout
        for form in FORMS), r.stdout
