"""Live evaluation through Hooks.after_step: `eval.step` events every N steps with the
held-out simulated acceptance, rising as the drafter learns, equal to an offline evaluation."""

from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, rule_batch
from dflash.consumers.evaluation.live_eval import eval_hook, simulated_acceptance
from dflash.consumers.training.train import train
from dflash.consumers.training.train_config import Hooks, resolve_signal
from dflash.consumers.training.config import TrainConfig
import pytest

pytestmark = pytest.mark.unit

LAYERS, B, STEPS, EVERY = [1, 2], 4, 120, 40


def test_eval_events_track_learning_on_held_out_batches(heads):
    cfg = TrainConfig(draft_layers=2, target_layers=tuple(LAYERS), block_size=B, anchors=8, mask_token_id=MASK_ID,
                      lr=3e-3, total_steps=STEPS, log_position_every=0)
    signal = resolve_signal(cfg, heads)
    # Held out: seeds and sample IDs the training stream never uses.
    held_out = [rule_batch(heads.spec, LAYERS, seed=50_000 + i, sample_start=10_000 + 4 * i) for i in range(2)]
    stream = (rule_batch(heads.spec, LAYERS, seed=i, sample_start=4 * i) for i in range(STEPS))
    with capture_logs() as logs:
        state = train(cfg, heads, stream, hooks=Hooks(after_step=eval_hook(heads, signal, held_out, EVERY)))
    evals = [e for e in logs if e["event"] == "eval.step"]
    assert [e["step"] for e in evals] == [40, 80, 120]
    assert evals[0]["tau"] + 1.0 < evals[-1]["tau"] <= B  # it is learning the stream (tau 1.2 -> 2.95 seen)
    assert len(evals[-1]["acc_by_position"]) == B - 1 and evals[-1]["blocks"] == 2 * 4 * 8
    assert state.model.training  # evaluation hands the model back in training mode
    # The last event is the finished model's offline figure: same anchors, same weights.
    offline = simulated_acceptance(state.model, heads, held_out, signal)
    assert {k: evals[-1][k] for k in offline} == offline


def test_live_eval_measures_the_weights_before_they_train_the_batch(heads):
    """`--eval-every`'s hook: every EVERY steps, simulated acceptance of the weights of that
    step on the batch the next step is about to train, published for the heartbeat."""
    from dflash.consumers.evaluation.live_eval import LiveEval

    cfg = TrainConfig(draft_layers=2, target_layers=tuple(LAYERS), block_size=B, anchors=8, mask_token_id=MASK_ID,
                      lr=3e-3, log_position_every=0)
    signal = resolve_signal(cfg, heads)
    stream = [rule_batch(heads.spec, LAYERS, seed=i, sample_start=4 * i) for i in range(9)]
    stats: dict = {}
    with capture_logs() as logs:
        live = LiveEval(heads, signal, 4, stats=stats)
        full = train(cfg, heads, iter(stream), hooks=Hooks(before_step=live.before_step))
        upto4 = train(cfg, heads, iter(stream[:4]))  # same seed: the same weights after 4 steps
    sims = [e for e in logs if e["event"] == "eval.step"]
    assert [(e["step"], e["batch_id"]) for e in sims] == [(4, stream[4].batch_id), (8, stream[8].batch_id)]
    # samples trained by the weights evaluated: the x axis of tau against samples (bench/tau_curve.py)
    assert [e["samples"] for e in sims] == [sum(len(b.samples) for b in stream[:n]) for n in (4, 8)]
    assert sims[0]["unseen_frac"] == 1.0 and full.step == 9
    offline = simulated_acceptance(upto4.model, heads, [stream[4]], signal)
    assert {k: sims[0][k] for k in offline} == offline  # step 4's weights, the batch not trained yet
    ev = stats["eval"]
    assert ev["step"] == 8 and ev["sim_tau"] == sims[1]["tau"] and ev["unseen_frac"] == 1.0
    assert ev["tau"] is None and ev["prompts"] == 0  # no --eval-prompts: simulated only


def test_live_eval_is_late_not_lost_and_counts_seen_samples(heads):
    from dflash.consumers.evaluation.live_eval import LiveEval
    from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig
    from dflash.consumers.checkpoints.record import TrainedRecord

    cfg = TrainConfig(draft_layers=1, target_layers=tuple(LAYERS), block_size=B, anchors=8, mask_token_id=MASK_ID)
    signal = resolve_signal(cfg, heads)
    model = DFlashDraft(DrafterConfig.from_target(heads.spec, 1, len(LAYERS)))
    batch = rule_batch(heads.spec, LAYERS, seed=1, sample_start=0, epoch=1)  # samples 0..3 of epoch 1
    record = TrainedRecord()
    record.add([(0, 0), (0, 1), (0, 2)])  # three of them were trained in epoch 0
    with capture_logs() as logs:
        live = LiveEval(heads, signal, 3, stats={})
        live.before_step(2, model, batch, record, 8)  # not due
        live.before_step(3, model, None, record, 12)  # due, but this rank has no batch: later
        live.before_step(4, model, batch, record, 12)
        live.before_step(5, model, batch, record, 16)  # next due at 6
    (e,) = [e for e in logs if e["event"] == "eval.step"]
    assert e["step"] == 4 and e["samples"] == 12 and e["unseen_frac"] == 0.25
    assert live.stats["eval"]["step"] == 4 and live.stats["eval"]["unseen_frac"] == 0.25
