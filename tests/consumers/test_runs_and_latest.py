"""Runs and `latest` (issue 19, finding 6): a local consumer never writes into an existing
run (a broker's), `runs/latest` never moves back nor from a broker run to a local one,
pruning never deletes the checkpoint just written, and `--resume` of another run's
checkpoint against a fresh broker run is refused at start (its held samples would all be
skipped: 0 steps, "every sample trained")."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, random_batch
from dflash.consumers.checkpoints.checkpoint import step_dirs, write_checkpoint
from dflash.consumers.process.consume_command import main
from dflash.consumers.process.join import RunConfigMismatch, resume_point
from dflash.protocol.messages import RunConfig
from dflash.consumers.training.train import train
from dflash.consumers.training.config import TrainConfig
from dflash.runtime.run import make_run_dir, new_run_id, point_latest

from tests.harness.broker import BrokerProc
from tests.harness.wait import wait_until
from tests.consumers.test_consume_broker import Consumer

pytestmark = pytest.mark.integration

LAYERS = [1, 2]
# the run config of a fresh broker run: it names no checkpoint to start from
FRESH = RunConfig(epochs=1, seed=0, lease_size=256, max_message_bytes=1 << 30, max_credit=64)


def _args(target_dir, runs, *extra):
    return ["--target", str(target_dir), "--runs-dir", str(runs), "--draft-layers", "1", "--target-layers", "1,2",
            "--block-size", "4", "--anchors", "6", "--mask-token-id", str(MASK_ID), "--synthetic-seq-len", "32",
            "--synthetic-seqs", "2", "--instance", "local-cpu", *extra]


def _broker_run(runs: Path, run_id: str) -> Path:
    """A broker run's folder as dflash-broker leaves it (run.json with its role's fields)."""
    d = make_run_dir(run_id, runs)
    (d / "run.json").write_text(json.dumps({"run_id": run_id, "outcome": "completed", "config": {"seed": 0},
                                            "broker": {"host": "h", "pid": 1}, "facts": {}}))
    return d


def test_a_local_run_id_never_writes_into_an_existing_run(target_dir, tmp_path):
    runs = tmp_path / "runs"
    broker_run = _broker_run(runs, new_run_id(1_700_000_000))
    before = (broker_run / "run.json").read_text()
    point_latest(broker_run.name, runs)
    r = CliRunner().invoke(main, _args(target_dir, runs, "--synthetic-batches", "2", "--run-id", broker_run.name))
    assert r.exit_code == 2, r.output
    assert f"--run-id {broker_run.name}" in r.output and "exists" in r.output
    assert (broker_run / "run.json").read_text() == before
    assert not any((broker_run / "checkpoints").iterdir()) and not any((broker_run / "logs").iterdir())
    assert (runs / "latest").resolve() == broker_run.resolve()


def test_latest_moves_only_forward_and_a_local_run_never_takes_it_from_a_broker_run(target_dir, tmp_path):
    runs = tmp_path / "runs"
    old, new = new_run_id(1_700_000_000), new_run_id(1_700_000_100)
    make_run_dir(old, runs)
    make_run_dir(new, runs)
    point_latest(new, runs)
    point_latest(old, runs)  # backwards: ignored
    assert os.readlink(runs / "latest") == new
    _broker_run(runs, new)
    r = CliRunner().invoke(main, _args(target_dir, runs, "--synthetic-batches", "1"))
    assert r.exit_code == 0, r.output
    assert os.readlink(runs / "latest") == new  # the local run is newer, but latest stays on the broker run
    # Without a broker run, a local run is what `latest` names (dflash-status/logs/plot of it).
    runs2 = tmp_path / "runs2"
    r = CliRunner().invoke(main, _args(target_dir, runs2, "--synthetic-batches", "1"))
    assert r.exit_code == 0, r.output
    (local,) = [p for p in runs2.iterdir() if p.name != "latest"]
    assert os.readlink(runs2 / "latest") == local.name


def test_pruning_never_deletes_the_checkpoint_just_written(heads, tmp_path):
    from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig

    root = tmp_path / "checkpoints"
    model = DFlashDraft(DrafterConfig.from_target(heads.spec, 1, len(LAYERS)))
    opt = torch.optim.AdamW(model.parameters())
    for step in (10, 11, 12, 2):  # step-2: a consumer restarted from an earlier point writes into this folder
        write_checkpoint(root, step, model.state_dict(), opt.state_dict(), state={}, rng=[torch.get_rng_state()],
                         drafter_config={}, keep=3)
    assert [s for s, _ in step_dirs(root)] == [2, 11, 12]


def test_resume_of_another_runs_checkpoint_in_a_fresh_broker_run_is_refused(tmp_path):
    runs = tmp_path / "runs"
    other = runs / new_run_id(1_700_000_000) / "checkpoints" / "step-4"
    other.mkdir(parents=True)
    (other / "state.json").write_text("{}")
    this = new_run_id(1_700_000_500)
    for ref in ("latest", str(other), other.parent.parent.name):
        with pytest.raises(RunConfigMismatch, match=rf"checkpoint of run {other.parent.parent.name}, but this broker "
                           rf"run {this} is a fresh run.*dflash-broker --resume {other.parent.parent.name}"):
            resume_point(ref, FRESH, runs, run_id=this)
    # This run's own checkpoint (rank 0 died between checkpoint and commit) is allowed.
    own = runs / this / "checkpoints" / "step-2"
    own.mkdir(parents=True)
    (own / "state.json").write_text("{}")
    assert resume_point(str(own), FRESH, runs, run_id=this) == str(own)


def test_a_consumer_resuming_latest_against_a_fresh_broker_run_exits_at_start(target_dir, heads, tmp_path):
    runs = tmp_path / "runs"
    cfg = TrainConfig(draft_layers=1, target_layers=tuple(LAYERS), block_size=4, anchors=6, mask_token_id=MASK_ID,
                      log_position_every=0, max_steps=1)
    old = make_run_dir(new_run_id(1_700_000_000), runs)
    with capture_logs():
        train(cfg, heads, [random_batch(heads.spec, LAYERS, [16], seed=0)], ckpt_root=old / "checkpoints")
    b = BrokerProc(runs, ["--num-samples", "4"])
    try:
        c = Consumer(b, target_dir, tmp_path / "c.out", "--instance", "resumer", "--resume", "latest")
        code, out = c.wait(90)
        assert code == 2, out[-1500:]
        last = out.strip().splitlines()[-1]
        assert f"checkpoint of run {old.name}" in last and f"dflash-broker --resume {old.name}" in last
        assert not c.events("train.start")
    finally:
        b.stop()


def test_resume_latest_before_any_checkpoint_starts_as_without_resume_and_says_so(target_dir, tmp_path):
    # The README's restart command works on a first start, and on a restart before the first
    # --save-every: nothing to resume is said in the log, not an exit 2 (issue 29).
    runs = tmp_path / "runs"
    with capture_logs() as logs:
        assert resume_point("latest", FRESH, runs, run_id=new_run_id(1_700_000_000)) is None
    [line] = [e for e in logs if e["event"] == "consume.resume_point"]
    assert line["checkpoint"] is None and "no checkpoint under" in line["why"] and "nothing to resume" in line["why"]
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):  # a named one must exist
        resume_point(str(tmp_path / "nowhere"), FRESH, runs, run_id=new_run_id(1_700_000_000))
    # A local run likewise trains from scratch.
    r = CliRunner().invoke(main, _args(target_dir, runs, "--synthetic-batches", "2", "--resume", "latest"))
    assert r.exit_code == 0, r.output
    (run,) = [p for p in runs.iterdir() if p.name != "latest"]
    events = [json.loads(x) for x in (run / "logs" / "consumer-local-cpu.jsonl").read_text().splitlines()]
    assert [e["checkpoint"] for e in events if e["event"] == "consume.resume_point"] == [None]
    assert [e["step"] for e in events if e["event"] == "train.step"] == [1, 2]
    # Against a broker: the consumer joins and trains.
    b = BrokerProc(runs / "b", ["--num-samples", "4"])
    c = Consumer(b, target_dir, tmp_path / "c.out", "--instance", "restarted", "--resume", "latest")
    try:
        wait_until(lambda: c.events("consume.resume_point") or c.proc.poll() is not None, 120, "the resume point")
        [said] = c.events("consume.resume_point")
        assert said["checkpoint"] is None and "nothing to resume" in said["why"], said
        assert c.proc.poll() is None, c.out.read_text()[-1500:]  # still in the run, waiting for a producer
    finally:
        b.stop()
        c.wait(60)
