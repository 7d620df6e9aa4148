"""Live evaluation through Hooks.after_step: `eval.step` events every N steps with the
held-out simulated acceptance, rising as the drafter learns, equal to an offline evaluation."""

from structlog.testing import capture_logs

from consumer_helpers import MASK_ID, rule_batch
from dflash.consumers.live_eval import eval_hook, simulated_acceptance
from dflash.consumers.train import Hooks, TrainConfig, resolve_signal, train

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
