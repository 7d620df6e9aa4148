"""dflash-consume against a real broker process: refusals, a lost broker and batches of
other target layers end it with a one-line reason and a non-zero exit; starved
data-parallel ranks wait without spinning a core and stop together on one SIGTERM.
(The full pipeline with real producers: tests/test_pipeline_e2e.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests.harness.tiny import MASK_ID

from tests.harness.fakes import FakeProducer  # a hand-written producer, from PROTOCOL.md
from tests.harness.broker import BrokerProc

pytestmark = pytest.mark.integration


class Consumer:
    """A dflash-consume process; output goes to a file, read when needed."""

    def __init__(self, broker: BrokerProc, target_dir, out: Path, *extra: str, mask_token_id: int = MASK_ID):
        env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
        env.update(OMP_NUM_THREADS="1", DFLASH_LOG_JSON="1")
        self.out = out
        with open(out, "w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dflash.consumers.process.consume_command", "--broker", broker.control, "--target",
                 str(target_dir), "--runs-dir", str(broker.runs_dir), "--draft-layers", "1", "--block-size", "4",
                 "--anchors", "6", "--mask-token-id", str(mask_token_id), *extra],
                stdout=f, stderr=subprocess.STDOUT, env=env)

    def wait(self, timeout_s: float = 60) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return code, self.out.read_text()

    def events(self, name: str) -> list[dict]:
        return [e for e in map(json.loads, (x for x in self.out.read_text().splitlines() if x.startswith("{")))
                if e["event"] == name]

    def cpu_s(self) -> float:
        """User + system CPU seconds this process has used so far (Linux /proc)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _consumers_waiting(b: BrokerProc, n: int, timeout_s: float = 90) -> list[dict]:
    """The broker's status rows of `n` consumers once all report state 'waiting'."""
    end = time.monotonic() + timeout_s
    rows: list = []
    while time.monotonic() < end:
        st = b.ask() or {}
        rows = [p for p in st.get("peers", []) if p["role"] == "consumer"]
        if len(rows) == n and all(p["stats"].get("state") == "waiting" for p in rows):
            return rows
        time.sleep(0.2)
    raise AssertionError(f"consumers not all waiting after {timeout_s}s: {rows}")


def _consumer_joined(b: BrokerProc, timeout_s: float = 90) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if any(p["role"] == "consumer" for p in (b.ask() or {}).get("peers", [])):
            return
        time.sleep(0.2)
    raise AssertionError(f"no consumer joined the broker after {timeout_s}s")


def _wait_for_event(c: "Consumer", name: str, timeout_s: float = 90) -> dict:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        found = c.events(name)
        if found:
            return found[0]
        if c.proc.poll() is not None:
            raise AssertionError(f"consumer exited {c.proc.returncode} before {name}: {c.out.read_text()[-1500:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {name} from the consumer after {timeout_s}s")


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@pytest.mark.parametrize("elastic", [False, True], ids=["fixed", "elastic"])
def test_starved_ranks_wait_without_spinning_and_one_sigterm_stops_both_or_takes_one_out(target_dir, tmp_path,
                                                                                          elastic):
    b = BrokerProc(tmp_path / "runs", ["--consumers", "2", "--num-samples", "8",
                                       "--elastic" if elastic else "--no-elastic"])
    # Layers given: a consumer left to auto waits for a producer's layers before it trains (and forms no group)
    cs = [Consumer(b, target_dir, tmp_path / f"c{i}.out", "--instance", f"c{i}", "--target-layers", "1")
          for i in range(2)]
    try:
        rows = _consumers_waiting(b, 2)  # no producer: the queue stays empty
        before = [c.cpu_s() for c in cs]
        time.sleep(2.0)
        used = [c.cpu_s() - t for c, t in zip(cs, before)]
        # Waiting is a blocking queue wait plus one tiny collective every 0.5 s; a polling
        # loop would burn most of a core (>1 s here).
        assert all(u < 0.4 for u in used), used
        rank1 = next(p for p in rows if p["rank"] == 1)
        os.kill(rank1["pid"], signal.SIGTERM)  # rank 0 learns it through the step's collective
        by_rank = {p["rank"]: c for p in rows for c in cs if c.proc.pid == p["pid"]}
        if elastic:  # only the signalled one goes (issue 29); the broker's stop ends the other
            leaver = by_rank[1].wait(60)
            assert by_rank[0].proc.poll() is None, by_rank[0].out.read_text()[-1500:]
            b.stop()
            results = [by_rank[0].wait(60), leaver]
        else:
            results = [by_rank[0].wait(60), by_rank[1].wait(60)]
    finally:
        for c in cs:
            if c.proc.poll() is None:
                c.proc.kill()
        b.stop()
    assert [code for code, _ in results] == [0, 0], [out[-1500:] for _, out in results]
    ends = {r: c.events("train.end") for r, c in by_rank.items()}
    want = {0: "stop", 1: "left" if elastic else "stop"}
    got = {r: [(e["reason"], e["step"]) for e in ev] for r, ev in ends.items()}
    assert got == {r: [(w, 0)] for r, w in want.items()}, got
    left = b.events("broker.peer_left")
    assert sorted(e["reason"] for e in left) == sorted(want.values())


def test_refused_or_lost_broker_exits_1_with_the_reason(target_dir, tmp_path):
    b = BrokerProc(tmp_path / "runs", ["--num-samples", "8"])  # heartbeat 0.2 s, timeout 1.5 s
    try:
        refused = Consumer(b, target_dir, tmp_path / "refused.out", "--instance", "r",
                           "--run-id", "20200101T000000Z-dead")
        lost = Consumer(b, target_dir, tmp_path / "lost.out", "--instance", "l")
        # Both consumers start at once and each imports torch and transformers (about
        # 10 s of CPU): a deadline for a hang, with room for a loaded 2-core machine.
        code, out = refused.wait(180)
        assert code == 1
        assert _last_line(out).startswith("error: broker rejected us: run '20200101T000000Z-dead' is not the run")
        assert "[run_mismatch]" in _last_line(out)

        _consumers_waiting(b, 1)
        b.proc.kill()  # SIGKILL: no stop, no goodbye
        code, out = lost.wait(30)
    finally:
        b.stop()
    assert code == 1
    assert _last_line(out).startswith(f"error: broker {b.control} silent for"), out[-800:]


def test_broker_shutdown_makes_a_consumer_stop_and_exit_0(target_dir, tmp_path):
    """PROTOCOL.md 4.6: `stop {reason: shutdown}` means save what you have and leave."""
    b = BrokerProc(tmp_path / "runs", ["--num-samples", "8"])
    c = Consumer(b, target_dir, tmp_path / "c.out", "--instance", "c")
    try:
        _consumers_waiting(b, 1)
        assert b.stop() == 0  # SIGTERM
        code, out = c.wait(30)
    finally:
        b.stop()
    assert code == 0, out[-800:]
    assert [e["reason"] for e in c.events("link.stop")] == ["shutdown"]
    # No producer came: it was still waiting for the run's layers, so no drafter was built
    assert c.events("train.start") == [] and c.events("consume.waiting_for_layers")
    assert [e["reason"] for e in c.events("consume.done")] == ["stop"]  # not taken for the end of the stream

    # With its layers given it trains at once, and a shutdown is a stop of training
    b = BrokerProc(tmp_path / "runs2", ["--num-samples", "8"])
    c = Consumer(b, target_dir, tmp_path / "c2.out", "--instance", "c", "--target-layers", "1")
    try:
        _consumers_waiting(b, 1)
        assert b.stop() == 0
        code, out = c.wait(30)
    finally:
        b.stop()
    assert code == 0, out[-800:]
    assert [e["reason"] for e in c.events("train.end")] == ["stop"]


def test_batches_of_other_layers_or_another_target_are_refused(target_dir, tmp_path):
    """The fake producer's batches carry layers [1, 2] of a 4-wide target; this drafter
    trains on layer [1] of a 64-wide one."""
    b = BrokerProc(tmp_path / "runs", ["--num-samples", "4"])
    try:
        early = Consumer(b, target_dir, tmp_path / "early.out", "--instance", "early")
        _wait_for_event(early, "consume.waiting_for_layers")  # joined before any producer: waits for its facts
        producer = FakeProducer(b.control, "fake-p", n_samples=4)
        threading.Thread(target=producer.run_to_end, daemon=True).start()
        code, out = early.wait(60)
        assert code == 2
        # Refused on the run's facts before a drafter was built (it used to guess its layers
        # and die at the first batch)
        assert "this run's target has hidden size 4, --target here has 64" in _last_line(out), out[-800:]
        assert early.events("train.start") == [] and early.events("train.batch_mismatch") == []

        # Joining once the run's facts are known: refused at the welcome, before training.
        late = Consumer(b, target_dir, tmp_path / "late.out", "--instance", "late")
        code, out = late.wait(60)
        assert code == 2
        assert "this run's target has hidden size 4, --target here has 64" in _last_line(out), out[-800:]
    finally:
        b.stop()


def test_a_resumed_run_names_the_checkpoint_to_start_from(tmp_path):
    """PROTOCOL.md 8: the newest *commit* of the chain, not a newer checkpoint on disk."""
    from dflash.consumers.process.join import RunConfigMismatch, resume_point
    from dflash.protocol.messages import CommitPoint, RunConfig

    runs = tmp_path / "runs"
    old = runs / "20260101T000000Z-aaaa" / "checkpoints"
    for step in (10, 20):  # step-20 was written but its commit never reached the broker
        (old / f"step-{step}").mkdir(parents=True)
        (old / f"step-{step}" / "state.json").write_text("{}")
    fresh = RunConfig(epochs=1, seed=0, lease_size=256, max_message_bytes=1 << 30, max_credit=64)
    committed = replace(fresh, parent_run="20260101T000000Z-aaaa",
                        resumed_from=CommitPoint("20260101T000000Z-aaaa", 10, str(old / "step-10")))
    assert resume_point(None, committed, runs) == str((old / "step-10").resolve())
    assert resume_point("latest", committed, runs) == str((old / "step-10").resolve())
    with pytest.raises(RunConfigMismatch, match="leave out --resume"):
        resume_point(str(old / "step-20"), committed, runs)
    assert resume_point("latest", replace(fresh, parent_run="x"), runs) is None  # nothing committed yet
    assert resume_point("latest", fresh, runs) == str(old / "step-20")  # not a resumed run: as asked
    assert resume_point(None, fresh, runs) is None


def test_the_schedule_runs_over_the_brokers_planned_samples(target_dir, tmp_path):
    """No --total-samples: the lr follows epochs x samples as the broker's heartbeat says,
    down to --min-lr at the last sample."""
    b = BrokerProc(tmp_path / "runs", ["--num-samples", "6", "--epochs", "2"])
    try:
        c = Consumer(b, target_dir, tmp_path / "c.out", "--instance", "c", "--min-lr", "1e-5", "--lr", "1e-3")
        cfg = {"target": "fake", "layer_ids": [1, 2], "hidden_size": 64, "dataset": {"n_samples": 6, "fingerprint": "fp"}}
        producer = FakeProducer(b.control, "fake-p", n_samples=6, per_batch=1, width=128, config=cfg)
        threading.Thread(target=producer.run_to_end, daemon=True).start()
        code, out = c.wait(90)
    finally:
        b.stop()
    assert code == 0, out[-1500:]
    assert [(p["by"], p["length"], p["source"]) for p in c.events("train.schedule")] == [("samples", 12, "broker")]
    steps = c.events("train.step")
    assert len(steps) == 12 and steps[-1]["lr"] == pytest.approx(1e-5)
    assert all(a["lr"] > b_["lr"] for a, b_ in zip(steps, steps[1:]))  # past the warmup (1 sample > 4%): decaying


def test_a_consumer_started_before_any_producer_trains_on_the_runs_layers(tmp_path):
    """Issue 22 item 2: real broker, consumer and producer processes; the producer captures
    --target-layers 0,2, not the default [1, 2, 3] of this 6-layer target. The consumer,
    started first with --target-layers auto, builds its drafter on the run's layers."""
    from dflash.tools.tiny import MASK_TOKEN, tiny_target
    from transformers import AutoTokenizer

    import dflash.producers.sample_data as sample_data

    target = tiny_target()
    mask = AutoTokenizer.from_pretrained(target).convert_tokens_to_ids(MASK_TOKEN)
    data = tmp_path / "chats.jsonl"
    chats = (Path(sample_data.__file__).parent / "chats.jsonl").read_text().splitlines()[:6]
    data.write_text("\n".join(chats) + "\n")
    b = BrokerProc(tmp_path / "runs", ["--epochs", "1", "--lease-size", "4"])
    producer = None
    try:
        c = Consumer(b, target, tmp_path / "c.out", "--instance", "c", mask_token_id=mask)
        _consumer_joined(b)
        env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
        env.update(OMP_NUM_THREADS="1", DFLASH_LOG_JSON="1")
        with open(tmp_path / "p.out", "w") as f:
            producer = subprocess.Popen(
                [sys.executable, "-m", "dflash.producers.produce_command", "--broker", b.control, "--runs-dir", str(b.runs_dir),
                 "--instance", "p0", "--device", "cpu", "--target", str(target), "--data", str(data),
                 "--target-layers", "0,2", "--token-budget", "256", "--max-length", "128", "--max-batch-size", "2",
                 "--lease-size", "4", "--prefetch", "1"], stdout=f, stderr=subprocess.STDOUT, env=env)
        code, out = c.wait(180)
        assert producer.wait(60) == 0, (tmp_path / "p.out").read_text()[-1500:]
    finally:
        if producer is not None and producer.poll() is None:
            producer.kill()
        b.stop()
    assert code == 0, out[-1500:]
    (known,) = c.events("consume.layers_known")
    assert known["layer_ids"] == [0, 2]
    (start,) = c.events("train.start")
    assert start["signal"]["target_layers"] == [0, 2]
    steps = c.events("train.step")
    assert steps and c.events("train.batch_mismatch") == []
    (done,) = c.events("consume.done")
    assert done["reason"] == "end_of_stream" and done["samples"] == 6


def test_a_run_stopped_before_its_plan_says_its_lr_never_annealed(target_dir, tmp_path):
    """A shutdown mid-plan (SIGTERM to the broker, as at a --time-budget run stopped early or
    any run): the consumer checkpoints, commits and says, in `train.end` and a
    `train.unannealed` warning, that its last lr is above --min-lr."""
    b = BrokerProc(tmp_path / "runs", ["--num-samples", "6", "--epochs", "50"])
    try:
        c = Consumer(b, target_dir, tmp_path / "c.out", "--instance", "c", "--min-lr", "1e-5", "--lr", "1e-3")
        cfg = {"target": "fake", "layer_ids": [1, 2], "hidden_size": 64, "dataset": {"n_samples": 6, "fingerprint": "fp"}}
        producer = FakeProducer(b.control, "fake-p", n_samples=6, per_batch=1, width=128, config=cfg)
        threading.Thread(target=producer.run_to_end, daemon=True).start()
        _wait_for_event(c, "train.step")
        assert b.stop() == 0  # SIGTERM: consumers checkpoint, commit and leave
        code, out = c.wait(60)
    finally:
        b.stop()
    assert code == 0, out[-1500:]
    (end,) = c.events("train.end")
    (warned,) = c.events("train.unannealed")
    assert end["reason"] == warned["reason"] == "stop" and 0 < end["progress"] < 1 and end["lr"] > 1e-5
    assert warned["planned_samples"] == 300 and warned["samples"] == end["samples"] >= 1
    assert warned["min_lr"] == 1e-5 and "--resume" in warned["hint"]
