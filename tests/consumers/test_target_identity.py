"""A wrong target is refused everywhere (issue 19, finding 4): the target identity (config
and heads hashes) is one of the run's facts, fixed by the first producer and checked for
every producer and consumer by the broker (and by the consumer itself), recorded by export
and checked by dflash-eval; token IDs outside the vocabulary are refused naming the batch."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, batch_message, random_batch, tiny_target
from dflash.consumers.training.batch import BatchMismatch
from dflash.consumers.export.export import ExportError, check_drafter_target, export_checkpoint
from dflash.consumers.process.join import RunConfigMismatch, check_run_target
from dflash.protocol.messages import RunConfig
from dflash.runtime.target_heads import identity_of, load_target_heads
from dflash.consumers.training.train import train
from dflash.consumers.training.config import TrainConfig

from tests.harness.fakes import FakeConsumer, FakeProducer, Rejected
from tests.harness.broker import BrokerProc
from tests.consumers.test_consume_broker import Consumer  # a dflash-consume process

pytestmark = pytest.mark.integration

LAYERS = [1, 2]


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """The same shape as `target_dir`, other weights: only the heads hash tells them apart."""
    return tiny_target(tmp_path_factory.mktemp("other"), seed=1)


def _producer_config(identity: dict, n: int = 4) -> dict:
    return {"target": "tiny", "layer_ids": LAYERS, "hidden_size": 64, "target_id": identity,
            "dataset": {"n_samples": n, "fingerprint": "fp"}}


def test_identity_read_from_16_rows_equals_the_loaded_heads(target_dir, heads, tmp_path):
    assert identity_of(target_dir) == heads.identity
    tied = tiny_target(tmp_path / "tied", tie=True)
    sharded = tiny_target(tmp_path / "sharded", max_shard_size="20KB")
    for folder in (tied, sharded):
        assert identity_of(folder) == load_target_heads(folder).identity


def test_producers_and_consumers_of_another_target_are_refused_naming_both(target_dir, other_dir, tmp_path):
    mine, other = identity_of(target_dir), identity_of(other_dir)
    assert mine["heads_sha256"] != other["heads_sha256"]
    b = BrokerProc(tmp_path / "runs", ["--num-samples", "4"])
    try:
        p1 = FakeProducer(b.control, "p-a", n_samples=4, config=_producer_config(mine))
        assert p1.welcome["run_config"]["target_id"] == mine
        assert json.loads((b.run_dir / "run.json").read_text())["facts"]["target_id"] == mine
        with pytest.raises(Rejected, match=r"config_mismatch: this producer's --target is qwen3 \(config "
                           rf"{other['config_sha256'][:12]}, heads {other['heads_sha256'][:12]}\), this run's "
                           rf"target .* is qwen3 \(config {mine['config_sha256'][:12]}, heads "
                           rf"{mine['heads_sha256'][:12]}\)"):
            FakeProducer(b.control, "p-b", n_samples=4, config=_producer_config(other))
        with pytest.raises(Rejected, match=rf"config_mismatch: this consumer's --target .*heads "
                           rf"{other['heads_sha256'][:12]}.*heads {mine['heads_sha256'][:12]}"):
            FakeConsumer(b.control, "c-b", config={"signal": {"target": other}})
        FakeConsumer(b.control, "c-a", config={"signal": {"target": mine}}).close()  # the same target joins

        # The real consumer, loading the other target, exits 1 with the broker's reason.
        c = Consumer(b, other_dir, tmp_path / "c.out", "--instance", "real-other", "--target-layers", "1,2")
        code, out = c.wait(90)
        assert code == 1, out[-1500:]
        last = out.strip().splitlines()[-1]
        assert "config_mismatch" in last and other["heads_sha256"][:12] in last and mine["heads_sha256"][:12] in last
    finally:
        b.stop()


def test_a_first_producer_of_another_target_than_a_waiting_consumer_is_refused(target_dir, other_dir, tmp_path):
    mine, other = identity_of(target_dir), identity_of(other_dir)
    b = BrokerProc(tmp_path / "runs", ["--num-samples", "4"])
    try:
        c = FakeConsumer(b.control, "c-early", config={"signal": {"target": mine}})
        with pytest.raises(Rejected, match=rf"config_mismatch: this producer's --target .*heads "
                           rf"{other['heads_sha256'][:12]}.*live consumer c1's target .*{mine['heads_sha256'][:12]}"):
            FakeProducer(b.control, "p-other", n_samples=4, config=_producer_config(other))
        c.close()
    finally:
        b.stop()


def test_the_consumer_checks_the_runs_target_itself(target_dir, other_dir):
    mine, other = identity_of(target_dir), identity_of(other_dir)
    run = RunConfig(epochs=1, seed=0, lease_size=256, max_message_bytes=1 << 30, max_credit=64)
    check_run_target(replace(run, target_id=mine), mine)
    check_run_target(run, mine)  # no producer yet: batches are checked as they come
    with pytest.raises(RunConfigMismatch, match=rf"{mine['heads_sha256'][:12]}.*{other['heads_sha256'][:12]}"):
        check_run_target(replace(run, target_id=mine), other)


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_batch(heads):
    cfg = TrainConfig(draft_layers=1, target_layers=tuple(LAYERS), block_size=4, anchors=4, mask_token_id=MASK_ID,
                      log_position_every=0)
    # the header's producer: the batch ID's form is no name (issue 36, finding 7)
    bad = replace(random_batch(heads.spec, LAYERS, [16, 8], seed=3, batch_id="p7-12"), producer="east-cuda0-41")
    bad.input_ids[5] = heads.spec.vocab_size + 88  # what another target's tokenizer may emit
    with capture_logs() as logs, pytest.raises(BatchMismatch, match=r"batch p7-12 \(producer east-cuda0-41\) holds "
                                                                     r"token "
                                                                     r"IDs \d+\.\.600, outside this target's "
                                                                     r"vocabulary 0\.\.511"):
        train(cfg, heads, [batch_message(bad)])
    assert any(x["event"] == "train.batch_mismatch" and x["batch_id"] == "p7-12" for x in logs)


def test_a_bad_batch_ends_the_run_after_the_checkpoint_and_commit_of_what_was_trained(heads, tmp_path):
    """Issue 29 item 2: what the steps before a bad batch trained is committed before the
    consumer leaves on it, so the run keeps it (no lost job) and the next consumer starts
    there; the error then names the batch and what is wrong with it, for the broker."""
    from dflash.consumers.training.train_config import Hooks

    cfg = TrainConfig(draft_layers=1, target_layers=tuple(LAYERS), block_size=4, anchors=4, mask_token_id=MASK_ID,
                      log_position_every=0, save_every=0)
    good = random_batch(heads.spec, LAYERS, [16, 8], seed=3, batch_id="p1-1")
    bad = random_batch(heads.spec, LAYERS, [16], seed=4, batch_id="p1-2", sample_start=2)
    bad.input_ids[3] = heads.spec.vocab_size
    acked, commits = [], []
    hooks = Hooks(on_step=lambda step, ids: acked.append((step, ids)),
                  on_checkpoint=lambda step, path: commits.append((step, path.name)))
    with capture_logs() as logs, pytest.raises(BatchMismatch) as e:
        train(cfg, heads, [batch_message(good), batch_message(bad)], ckpt_root=tmp_path / "ck", hooks=hooks)
    assert (e.value.batch_id, e.value.fault) == ("p1-2", "token_ids")
    assert acked == [(1, ["p1-1"])] and commits == [(1, "step-1")]
    assert [x["reason"] for x in logs if x["event"] == "train.end"] == ["bad_batch"]


def test_export_records_the_target_and_eval_refuses_another(target_dir, other_dir, heads, tmp_path):
    cfg = TrainConfig(draft_layers=1, target_layers=tuple(LAYERS), block_size=4, anchors=4, mask_token_id=MASK_ID,
                      log_position_every=0, max_steps=1)
    root = tmp_path / "ck"
    with capture_logs():
        train(cfg, heads, [random_batch(heads.spec, LAYERS, [16], seed=0)], ckpt_root=root)
    ckpt = root / "step-1"
    out = export_checkpoint(ckpt, tmp_path / "export")
    assert json.loads((out / "manifest.json").read_text())["target"] == heads.identity
    for drafter in (ckpt, out):
        assert check_drafter_target(drafter, target_dir) == heads.identity
        with pytest.raises(ExportError, match=r"was trained for target qwen3 .*but --target .* is qwen3"):
            check_drafter_target(drafter, other_dir)


def test_dflash_eval_refuses_a_drafter_of_another_target(tmp_path):
    from dflash.tools.eval_command import main as eval_main
    from dflash.tools.tiny import tiny_target as tiny_with_tokenizer

    a, b = tiny_with_tokenizer(layers=4, seed=0), tiny_with_tokenizer(layers=4, seed=5)
    heads_a = load_target_heads(a)
    cfg = TrainConfig(draft_layers=1, target_layers=(1, 2), block_size=4, anchors=4, mask_token_id=None,
                      log_position_every=0, max_steps=1)
    with capture_logs():
        train(cfg, heads_a, [random_batch(heads_a.spec, [1, 2], [16], seed=0)], ckpt_root=tmp_path / "ck")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    r = CliRunner().invoke(eval_main, ["--target", str(b), "--drafter", str(tmp_path / "ck" / "step-1"),
                                       "--prompts", str(prompts), "--max-new-tokens", "2"])
    assert r.exit_code == 2, r.output
    assert "was trained for target" in r.output and identity_of(b)["heads_sha256"][:12] in r.output


def test_the_producer_states_the_identity_consumers_compute(target_dir, heads, tmp_path):
    from dflash.producers.build import target_identity

    assert target_identity(str(target_dir)) == heads.identity
    with capture_logs() as logs:
        assert target_identity(str(tmp_path)) is None  # not a model folder: stated as unknown, logged
    assert [x["event"] for x in logs] == ["produce.target_unidentified"]
