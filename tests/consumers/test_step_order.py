"""The order of a training step's effects (train.py `Trainer.step`), seen from the hooks of
a real run: a batch is acked only once the optimizer step that used it changed the
weights and the record holds its samples; its `train.step` line comes after the ack; a
checkpoint is committed only once it is on disk, whole, and holds what was acked. And the
one state form (`Trainer.state_dict`) is what a heal needs to go on as the source does."""

import io
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, random_batch
from dflash.consumers.checkpoints.checkpoint import read_state
from dflash.consumers.checkpoints.integrity import verify_checkpoint
from dflash.consumers.training.finite import NonFiniteStep
from dflash.consumers.checkpoints.record import TrainedRecord
from dflash.consumers.training.train import train
from dflash.consumers.training.train_config import Hooks
from dflash.consumers.training.config import TrainConfig
from dflash.runtime.run import make_run_dir, new_run_id

pytestmark = pytest.mark.unit

LAYERS = [1, 2]
CFG = TrainConfig(draft_layers=1, target_layers=tuple(LAYERS), block_size=4, anchors=4, mask_token_id=MASK_ID,
                  lr=1e-3, save_every=2, keep=5, log_position_every=0)


def _batches(spec, n):
    return [random_batch(spec, LAYERS, [12, 9], seed=i, batch_id=f"b{i}", sample_start=2 * i) for i in range(n)]


class Watch:
    """Hooks that check, when each effect happens, that the effects before it happened."""

    def __init__(self, batches):
        self.samples = {b.batch_id: (b.epoch, b.samples) for b in batches}
        self.events: list[tuple[str, int]] = []
        self.acked: list[str] = []
        self.weights: dict[int, torch.Tensor] = {}  # step -> the weights before it
        self.model = self.record = None

    def hooks(self) -> Hooks:
        return Hooks(before_step=self.before_step, on_step=self.on_step, on_metrics=self.on_metrics,
                     on_checkpoint=self.on_checkpoint)

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().flatten().clone() for p in self.model.parameters()])

    def before_step(self, done, model, batch, record, samples):
        # the samples trained so far are those of the batches acked so far
        assert samples == sum(len(self.samples[b][1]) for b in self.acked), (done, samples, self.acked)
        self.model, self.record = model, record
        self.weights[done + 1] = self._flat()
        self.events.append(("forward", done + 1))

    def on_step(self, step, batch_ids):
        # the optimizer step that trained the batch came first: the weights moved
        assert not torch.equal(self._flat(), self.weights[step]), f"step {step} acked before its optimizer step"
        for bid in batch_ids:  # and the record holds its samples
            epoch, samples = self.samples[bid]
            assert all(self.record.holds(epoch, s) for s in samples), f"{bid} acked before the record holds it"
        self.acked += batch_ids
        self.events.append(("ack", step))

    def on_metrics(self, step, line):
        assert line["step"] == step
        self.events.append(("log", step))

    def on_checkpoint(self, step, path):
        path = Path(path)
        # on disk, whole (the manifest checks every file), of this step, holding every acked sample
        assert path.name == f"step-{step}" and path.is_dir()
        verify_checkpoint(path)
        assert read_state(path)["step"] == step
        rec = TrainedRecord.load(path)
        for bid in self.acked:
            epoch, samples = self.samples[bid]
            assert all(rec.holds(epoch, s) for s in samples), f"commit of step {step} misses acked {bid}"
        self.events.append(("commit", step))


def test_ack_after_the_optimizer_step_and_commit_after_the_checkpoint_is_on_disk(heads, tmp_path):
    batches = _batches(heads.spec, 5)
    watch = Watch(batches)
    ckpt = make_run_dir(new_run_id(1_700_000_000), tmp_path) / "checkpoints"
    with capture_logs():
        st = train(CFG, heads, batches, ckpt_root=ckpt, hooks=watch.hooks())
    assert st.step == 5 and watch.acked == [b.batch_id for b in batches]
    expected = []
    for step in range(1, 6):
        expected += [("forward", step), ("ack", step), ("log", step)]
        if step % 2 == 0:
            expected.append(("commit", step))
    expected.append(("commit", 5))  # the final checkpoint, after the last step
    assert watch.events == expected


def test_a_step_with_a_non_finite_loss_is_neither_acked_nor_committed(heads, tmp_path):
    batches = _batches(heads.spec, 3)
    bad = batches[2]
    bad.hidden[:] = math.nan  # a producer's bad rows: the loss of step 3 is NaN
    watch = Watch(batches)
    ckpt = make_run_dir(new_run_id(1_700_000_000), tmp_path) / "checkpoints"
    with capture_logs() as logs, pytest.raises(NonFiniteStep, match="step 3"):
        train(CFG, heads, batches, ckpt_root=ckpt, hooks=watch.hooks())
    assert watch.acked == ["b0", "b1"]
    assert watch.events == [("forward", 1), ("ack", 1), ("log", 1), ("forward", 2), ("ack", 2), ("log", 2),
                            ("commit", 2), ("forward", 3)]
    assert [p.name for p in sorted(ckpt.iterdir())] == ["step-2"]  # nothing of step 3 reached the disk
    assert any(e["event"] == "train.non_finite" and e["step"] == 3 for e in logs)


def test_a_trainer_healed_with_anothers_state_dict_steps_as_it_does(heads):
    """The state a heal carries (`state_dict`, the same form a checkpoint writes) is all the
    next step depends on: after taking it, a fresh trainer's next step equals the source's."""
    from dflash.consumers.parallel.dist import Dist
    from dflash.consumers.training.train import Trainer

    batches = _batches(heads.spec, 4)
    a = Trainer(CFG, heads, Dist(), Hooks(), None, None)
    with capture_logs():
        a.join_or_resume(None)
        a.run(batches[:3])
    b = Trainer(CFG, heads, Dist(), Hooks(), None, None)  # fresh: the weights a started from
    sent = io.BytesIO()
    torch.save(a.state_dict(), sent)  # as torchft's transport does: a copy, not a's live tensors
    sent.seek(0)
    with capture_logs() as logs:
        b.join_or_resume(None)
        b._heal(torch.load(sent, weights_only=True))
    (healed,) = [e for e in logs if e["event"] == "train.healed"]
    assert healed["step"] == 3 and healed["previous_step"] == 0 and healed["record_samples"] == 6
    assert (b.state.step, b.state.samples, b.state.tokens) == (a.state.step, a.state.samples, a.state.tokens)
    assert b.state.record.lineage == a.state.record.lineage and b.state.record.origin == "healed"
    for t in (a, b):
        with capture_logs():
            t.run([batches[3]])
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)


def test_a_heal_from_another_signal_is_refused(heads):
    from dflash.protocol.training_signal import SignalMismatch
    from dflash.consumers.parallel.dist import Dist
    from dflash.consumers.training.train import Trainer

    a = Trainer(replace(CFG, anchors=5), heads, Dist(), Hooks(), None, None)
    b = Trainer(CFG, heads, Dist(), Hooks(), None, None)
    with capture_logs(), pytest.raises(SignalMismatch, match="anchors: 5 -> 4"):
        b._heal(a.state_dict())
    assert b.state.step == 0


def test_the_step_line_says_how_long_the_consumer_waited_for_its_batch(heads):
    """wait_s: the time a step waited for its batch (the starved share of wall_s, which
    the one-GPU benchmarks read); a batch that comes late shows in its step's line."""
    import time

    def slow(batches):
        for i, b in enumerate(batches):
            if i == 2:
                time.sleep(0.5)
            yield b

    with capture_logs() as logs:
        train(replace(CFG, save_every=0, stage_batches=False), heads, slow(_batches(heads.spec, 4)))
    steps = [e for e in logs if e["event"] == "train.step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]
    assert steps[2]["wait_s"] >= 0.45 and steps[2]["wait_s"] <= steps[2]["wall_s"]
    assert all(e["wait_s"] < 0.45 for i, e in enumerate(steps) if i != 2)
