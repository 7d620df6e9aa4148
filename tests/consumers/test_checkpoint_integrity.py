"""Damaged checkpoints are refused with a message naming the file (issue 19, finding 5):
a content hash per file, checked on resume, export and eval; non-finite weights refused on
load; a non-finite loss or gradient norm stops the run before anything is acked or saved."""

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, random_batch
from dflash.consumers.checkpoints.integrity import CheckpointDamaged, verify_checkpoint
from dflash.consumers.export.export import export_checkpoint, load_exported
from dflash.consumers.export.export_command import main as export_main
from dflash.consumers.training.finite import NonFiniteStep
from dflash.consumers.training.train import train
from dflash.consumers.training.train_config import Hooks
from dflash.consumers.training.config import TrainConfig

pytestmark = pytest.mark.unit

LAYERS = [1, 2]
CFG = TrainConfig(draft_layers=1, target_layers=tuple(LAYERS), block_size=4, anchors=4, mask_token_id=MASK_ID,
                  lr=2e-3, save_every=2, keep=3, log_position_every=0)


def _batches(spec, n, start=0):
    return [random_batch(spec, LAYERS, [20, 12], seed=i, batch_id=f"b{i}", sample_start=10 * i)
            for i in range(start, start + n)]


@pytest.fixture
def ckpt(heads, tmp_path):
    root = tmp_path / "run" / "checkpoints"
    with capture_logs():
        train(replace(CFG, max_steps=2), heads, _batches(heads.spec, 2), ckpt_root=root)
    return root / "step-2"


def test_every_file_is_hashed_at_save(ckpt):
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert set(manifest["files"]) == {"config.json", "model.safetensors", "optimizer.pt", "rng.pt", "state.json",
                                      "trained.safetensors"}
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in manifest["files"].values())
    verify_checkpoint(ckpt)  # intact: no error


def _stomp(path, offset_frac=0.6, n=4096):
    data = bytearray(path.read_bytes())
    at = int(len(data) * offset_frac)
    data[at:at + n] = b"\xff" * len(data[at:at + n])
    path.write_bytes(bytes(data))


def test_flipped_bytes_are_refused_on_resume_export_and_eval(heads, ckpt, tmp_path):
    _stomp(ckpt / "model.safetensors")
    with pytest.raises(CheckpointDamaged, match=r"model\.safetensors.*(sha256|content hash)") as e:
        train(replace(CFG, resume=str(ckpt), max_steps=3), heads, _batches(heads.spec, 1, 2))
    assert str(ckpt) in str(e.value)
    with pytest.raises(CheckpointDamaged, match=r"model\.safetensors"):
        export_checkpoint(ckpt, tmp_path / "exp")
    assert not (tmp_path / "exp").exists()
    with pytest.raises(CheckpointDamaged, match=r"model\.safetensors"):
        load_exported(ckpt)  # what dflash-eval loads
    r = CliRunner().invoke(export_main, [str(ckpt), str(tmp_path / "exp2")])
    assert r.exit_code == 2 and "model.safetensors" in r.output, r.output


def test_truncated_weights_name_the_path(heads, ckpt):
    (ckpt / "manifest.json").unlink()  # an older checkpoint, or one whose manifest went too
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointDamaged, match="model.safetensors") as e:
        train(replace(CFG, resume=str(ckpt), max_steps=3), heads, _batches(heads.spec, 1, 2))
    assert str(f) in str(e.value)
    with pytest.raises(CheckpointDamaged, match="model.safetensors"):
        load_exported(ckpt)


def test_non_finite_weights_are_refused_on_load(heads, ckpt, tmp_path):
    # Saved that way (the hashes match what is on disk): the values themselves are refused.
    f = ckpt / "model.safetensors"
    w = load_file(f)
    w["fc.weight"][0, 0] = float("nan")
    save_file(w, f, metadata={"format": "pt"})
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointDamaged, match=r"fc\.weight.*non-finite"):
        train(replace(CFG, resume=str(ckpt), max_steps=3), heads, _batches(heads.spec, 1, 2))
    with pytest.raises(CheckpointDamaged, match=r"fc\.weight.*non-finite"):
        export_checkpoint(ckpt, tmp_path / "exp")
    with pytest.raises(CheckpointDamaged, match=r"fc\.weight.*non-finite"):
        load_exported(ckpt)


def test_a_non_finite_loss_stops_the_run_and_nothing_of_its_step_is_acked_or_saved(heads, tmp_path):
    root = tmp_path / "run" / "checkpoints"
    batches = _batches(heads.spec, 4)
    batches[2].hidden[3, 5] = float("inf")  # a corrupt feature row from a producer
    acked, saved = [], []
    hooks = Hooks(on_step=lambda s, ids: acked.append((s, ids)), on_checkpoint=lambda s, p: saved.append(s))
    with capture_logs() as logs, pytest.raises(NonFiniteStep, match=r"step 3.*b2") as e:
        train(replace(CFG, save_every=1), heads, batches, ckpt_root=root, hooks=hooks)
    assert "not applied" in str(e.value)
    assert acked == [(1, ["b0"]), (2, ["b1"])] and saved == [1, 2]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-1", "step-2"]
    line = next(x for x in logs if x["event"] == "train.non_finite")
    assert line["step"] == 3 and line["batch_id"] == "b2" and line["log_level"] == "error"
