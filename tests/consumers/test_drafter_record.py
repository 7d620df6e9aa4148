"""The checkpoint knows what it holds (consumers/checkpoints/record.py): every (epoch, sample) the
weights were trained on, counted by the training loop itself, cumulative over resumes."""

from dataclasses import replace

import numpy as np
from safetensors.numpy import load_file
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, random_batch
from dflash.consumers.checkpoints.record import FILE, TrainedRecord
from dflash.consumers.training.train import train
from dflash.consumers.training.train_config import Hooks
from dflash.consumers.training.config import TrainConfig
from dflash.runtime.run import make_run_dir, new_run_id
import pytest

pytestmark = pytest.mark.unit

LAYERS = [1, 2]
CFG = TrainConfig(draft_layers=1, target_layers=tuple(LAYERS), block_size=4, anchors=4, mask_token_id=MASK_ID,
                  lr=1e-3, save_every=3, keep=5, log_position_every=0)


def _batches(spec, lo, hi, epoch=0):
    # batch i holds samples 3i, 3i+1 (3i+2 never appears: holes must read as 0)
    return [random_batch(spec, LAYERS, [12, 9], seed=i, batch_id=f"e{epoch}b{i}", sample_start=3 * i, epoch=epoch)
            for i in range(lo, hi)]


def test_record_counts_repeats_and_round_trips(tmp_path):
    r = TrainedRecord()
    assert r.add([(0, 5), (0, 1), (1, 0)]) == []
    assert r.add([(0, 5)]) == [(0, 5)] and r.repeats == 1
    assert r.holds(0, 5) and r.holds(1, 0) and not r.holds(0, 2) and not r.holds(2, 0) and not r.holds(0, 10**6)
    r.save(tmp_path)
    back = TrainedRecord.load(tmp_path)
    assert back.complete and back.repeats == 1 and back.count() == 3
    assert list(back.counts(0)) == [0, 1, 0, 0, 0, 2] and list(back.counts(1)) == [1]
    raw = load_file(tmp_path / FILE)  # readable without torch or dflash
    assert sorted(raw) == ["epoch.0", "epoch.1"] and raw["epoch.0"].dtype == np.uint8
    assert TrainedRecord.load(tmp_path / "nowhere") is None


def test_every_checkpoint_records_what_its_weights_saw_cumulatively_over_a_resume(heads, tmp_path):
    run_a, run_b = new_run_id(1_700_000_000), new_run_id(1_700_000_100)
    ckpt_a = make_run_dir(run_a, tmp_path) / "checkpoints"
    with capture_logs():
        train(CFG, heads, _batches(heads.spec, 0, 7), ckpt_root=ckpt_a)  # steps 1..7: saves 3, 6, 7
    r3, r7 = TrainedRecord.load(ckpt_a / "step-3"), TrainedRecord.load(ckpt_a / "step-7")
    assert list(np.flatnonzero(r3.counts(0))) == [0, 1, 3, 4, 6, 7]
    assert r7.count() == 14 and set(r7.counts(0)) == {0, 1} and r7.repeats == 0

    # resume from step 3: steps 4.. train batches 3..6 of epoch 0, then epoch 1
    ckpt_b = make_run_dir(run_b, tmp_path) / "checkpoints"
    with capture_logs() as logs:
        st = train(replace(CFG, resume=str(ckpt_a / "step-3")), heads,
                   _batches(heads.spec, 3, 7) + _batches(heads.spec, 0, 2, epoch=1), ckpt_root=ckpt_b)
    resumed = next(e for e in logs if e["event"] == "train.resumed")
    assert resumed["record_samples"] == 6 and resumed["record_complete"]
    final = TrainedRecord.load(st.last_checkpoint)
    assert final.complete and final.repeats == 0 and final.count() == 14 + 4
    assert list(final.counts(0)) == list(r7.counts(0)) and list(final.counts(1)) == [1, 1, 0, 1, 1]
    assert not [e for e in logs if e["event"] == "train.sample_repeated"]


def test_training_a_sample_twice_is_counted_and_logged(heads, tmp_path):
    ckpt = make_run_dir(new_run_id(1_700_000_000), tmp_path) / "checkpoints"
    twice = _batches(heads.spec, 0, 2) + _batches(heads.spec, 1, 2)
    with capture_logs() as logs:
        st = train(replace(CFG, save_every=0), heads, twice, ckpt_root=ckpt)
    rec = TrainedRecord.load(st.last_checkpoint)
    assert rec.repeats == 2 and list(rec.counts(0)) == [1, 1, 0, 2, 2]
    (ev,) = [e for e in logs if e["event"] == "train.sample_repeated"]
    assert ev["step"] == 3 and ev["pairs"] == [[0, 3], [0, 4]]


def test_resuming_a_checkpoint_without_a_record_marks_the_record_incomplete(heads, tmp_path):
    ckpt_a = make_run_dir(new_run_id(1_700_000_000), tmp_path) / "checkpoints"
    with capture_logs():
        train(CFG, heads, _batches(heads.spec, 0, 3), ckpt_root=ckpt_a)
    (ckpt_a / "step-3" / FILE).unlink()  # as written before records existed
    (ckpt_a / "step-3" / "manifest.json").unlink()  # (and before manifests, which list the record)
    ckpt_b = make_run_dir(new_run_id(1_700_000_100), tmp_path) / "checkpoints"
    with capture_logs() as logs:
        st = train(replace(CFG, resume=str(ckpt_a / "step-3")), heads, _batches(heads.spec, 3, 4), ckpt_root=ckpt_b)
    assert any(e["event"] == "train.record_missing" for e in logs)
    rec = TrainedRecord.load(st.last_checkpoint)
    assert not rec.complete and rec.count() == 2


def test_with_skip_held_a_sample_the_weights_hold_is_left_out_and_still_acked(heads, tmp_path):
    """A broker run makes again what its ledger had not committed (an ack lost in a crash);
    the record knows the weights hold it: those sequences are left out, the batch acked."""
    b = _batches(heads.spec, 0, 3)  # samples 0,1 | 3,4 | 6,7
    again = b[1]  # the whole batch again
    half = random_batch(heads.spec, LAYERS, [12, 9], seed=9, batch_id="half", sample_start=7)  # 7 held, 8 new
    acked = []
    hooks = Hooks(on_step=lambda s, ids: acked.append((s, ids)))
    ckpt = make_run_dir(new_run_id(1_700_000_000), tmp_path) / "checkpoints"
    with capture_logs() as logs:
        st = train(replace(CFG, save_every=0, skip_held=True), heads, b + [again, half], ckpt_root=ckpt, hooks=hooks)
    rec = TrainedRecord.load(st.last_checkpoint)
    assert rec.repeats == 0 and list(rec.counts(0)) == [1, 1, 0, 1, 1, 0, 1, 1, 1]
    # the held batch is acked at once at the current step; the half-held one trains sample 8 only
    assert acked == [(1, ["e0b0"]), (2, ["e0b1"]), (3, ["e0b2"]), (3, ["e0b1"]), (4, ["half"])]
    assert st.step == 4 and st.samples == 7
    skips = [(e["batch_id"], e["samples"], e["n"], e["of"]) for e in logs if e["event"] == "train.skip_held"]
    assert skips == [("e0b1", [3, 4], 2, 2), ("half", [7], 1, 2)]


def test_batch_select_keeps_whole_sequences(heads):
    b = random_batch(heads.spec, LAYERS, [5, 7, 3], seed=1, batch_id="x", sample_start=20)
    s = b.select([0, 2])
    assert (s.batch_id, s.samples, s.seq_lens, s.tokens) == ("x", [20, 22], [5, 3], 8)
    assert s.input_ids.tolist() == b.input_ids[:5].tolist() + b.input_ids[12:].tolist()
    assert s.loss_mask.tolist() == b.loss_mask[:5].tolist() + b.loss_mask[12:].tolist()
    assert (s.hidden[5:] == b.hidden[12:]).all() and s.hidden.shape[1] == b.hidden.shape[1]
