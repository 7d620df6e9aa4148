"""OOM in a training step: the step is split into micro-batches with gradient accumulation
and trains exactly what the unsplit step trains (issue 7).

The OOM is injected in the real loop through DFLASH_TEST_OOM_TOKENS (consumers/training/step_oom.py):
a micro-batch above that many tokens raises torch.OutOfMemoryError after its backward, so
the failed attempt has left its gradients in `.grad`, as a real OOM late in a backward
does. A real CPU allocator failure checks that such errors are recognised too.
"""

from dataclasses import replace

import pytest
import torch
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, random_batch
from dflash.consumers.training.config import TrainConfig
from dflash.consumers.training.step_oom import OomInjection, SequenceTooLarge, StepSplitter, is_oom
from dflash.consumers.training.step import add_feature_noise, draft_states, forward_backward, make_layout, noise_seed
from dflash.consumers.training.train import train
from dflash.consumers.training.train_config import Hooks, resolve_signal
from dflash.runtime.memory import bytes_asked

pytestmark = pytest.mark.unit

LAYERS = [1, 2]
CFG = TrainConfig(draft_layers=2, target_layers=tuple(LAYERS), block_size=4, anchors=6, mask_token_id=MASK_ID,
                  lr=2e-3, total_steps=8, log_position_every=0)
SHAPES = [[24, 17, 30, 12, 20], [40, 18, 22], [25, 25, 26, 9], [31, 14]]  # 103, 80, 85, 45 tokens
CPU = torch.device("cpu")


def _batches(spec):
    return [random_batch(spec, LAYERS, lens, seed=i, batch_id=f"b{i}", sample_start=10 * i)
            for i, lens in enumerate(SHAPES)]


def _train(heads, cfg, batches):
    """(state, logs, grads per step, weights per step) of a run of the real loop."""
    grads, weights = {}, {}

    def after_step(step, model):
        grads[step] = torch.cat([p.grad.flatten() for p in model.parameters()]).clone()
        weights[step] = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()

    with capture_logs() as logs:
        state = train(cfg, heads, batches, hooks=Hooks(after_step=after_step))
    return state, logs, grads, weights


@pytest.mark.parametrize("noise", [0.0, 0.3], ids=["noise_off", "noise_on"])
def test_split_steps_train_exactly_what_the_unsplit_steps_train(heads, monkeypatch, noise):
    # No clipping: it rescales the gradient, and so would hide a gradient counted twice
    # (a failed attempt's left in `.grad` adds a multiple of the batch's own).
    cfg = replace(CFG, feature_noise=noise, noise_schedule="linear", grad_clip=1e9)
    whole = _train(heads, cfg, _batches(heads.spec))
    monkeypatch.setenv("DFLASH_TEST_OOM_TOKENS", "44")  # 103 fails, then [41, 62], then 4 parts pass
    split = _train(heads, cfg, _batches(heads.spec))

    (_, logs, grads, weights), (_, ref_logs, ref_grads, ref_weights) = split, whole
    events = [e for e in logs if e["event"] == "train.oom_split"]
    assert [(e["step"], e["failed_splits"], e["splits"]) for e in events] == [(1, 1, 2), (1, 2, 4)]
    assert events[0]["tokens"] == 103 and events[0]["sequences"] == 5 and events[0]["part_tokens"] == 103
    assert events[1]["part_tokens"] == 62 and events[1]["ooms"] == 2 and events[1]["device"] == "cpu"
    assert "bytes_free" in events[0] and "bytes_peak" in events[0]
    steps = [e for e in logs if e["event"] == "train.step"]
    # The split is remembered: later batches start at 4 parts (capped by their sequences).
    assert [e["micro_batches"] for e in steps] == [4, 3, 4, 2] and {e["ooms"] for e in steps} == {2}
    assert [e["micro_batches"] for e in ref_logs if e["event"] == "train.step"] == [1, 1, 1, 1]
    for key in ("loss", "acc", "streak", "tokens"):  # the step's figures are the whole batch's
        assert [e[key] for e in steps] == pytest.approx(
            [e[key] for e in ref_logs if e["event"] == "train.step"], rel=1e-5)
    for s in range(1, 5):
        err = float((grads[s] - ref_grads[s]).norm() / ref_grads[s].norm())
        assert err < 1e-5, f"step {s}: split gradient differs from the unsplit one by {err:.2e} (relative)"
        # Adam divides by sqrt(v): where a gradient is ~0 a 1e-9 difference moves a weight
        # by up to ~lr * 1e-3 (as in test_drafter_dp.py); nothing more.
        torch.testing.assert_close(weights[s], ref_weights[s], rtol=1e-4, atol=1e-5, msg=f"step {s}")


def test_anchors_and_noise_of_a_sequence_do_not_depend_on_the_split(heads):
    signal = resolve_signal(CFG, heads)
    batch = random_batch(heads.spec, LAYERS, SHAPES[0], seed=5, sample_start=70, epoch=3)
    parts = batch.split(3)
    whole = make_layout(batch, signal, 11, CPU, "sdpa")
    cut = [a for p in parts for a in make_layout(p, signal, 11, CPU, "sdpa").anchors]
    assert all(torch.equal(a, b) for a, b in zip(whole.anchors, cut)) and len(cut) == 5

    def noisy(b, step):
        seeds = [noise_seed(11, b.epoch, s, step) for s in b.samples]
        return add_feature_noise(b.hidden.clone(), len(LAYERS), 0.3, b.seq_lens, seeds)

    assert torch.equal(noisy(batch, 7), torch.cat([noisy(p, 7) for p in parts]))  # bit for bit
    assert not torch.equal(noisy(batch, 7), noisy(batch, 8))  # fresh noise at every step
    # The noise is N(0, sigma^2 rms^2) per token and layer, and independent between sequences.
    x = batch.hidden.view(batch.tokens, len(LAYERS), -1)
    z = (noisy(batch, 7).view_as(x) - x) / (0.3 * x.pow(2).mean(-1, keepdim=True).sqrt())
    assert abs(float(z.mean())) < 0.03 and abs(float(z.std()) - 1.0) < 0.03
    first, second = z[:24].flatten()[:2000], z[24:41].flatten()[:2000]
    assert abs(float(torch.corrcoef(torch.stack([first, second]))[0, 1])) < 0.1
    # draft_states draws it: with noise on, its output follows the step it is given
    model = train(replace(CFG, max_steps=0), heads, []).model
    lay = make_layout(batch, signal, 11, CPU, "sdpa")
    with torch.no_grad():
        a, b = (draft_states(model, heads, batch, lay, signal, 0.3, seed=11, step=s) for s in (7, 7))
        c = draft_states(model, heads, batch, lay, signal, 0.3, seed=11, step=8)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_sequence_that_does_not_fit_alone_is_named(heads, monkeypatch):
    monkeypatch.setenv("DFLASH_TEST_OOM_TOKENS", "35")
    with capture_logs() as logs, pytest.raises(SequenceTooLarge) as err:
        train(CFG, heads, _batches(heads.spec)[1:])  # [40, 18, 22]: the 40 tokens of sample 10 never fit
    assert "sample 10 " in str(err.value) and "its 40 tokens do not fit even alone" in str(err.value)
    assert "--max-length" in str(err.value)
    (oom,) = [e for e in logs if e["event"] == "train.oom"]
    assert (oom["sample"], oom["seq_len"], oom["batch_id"], oom["step"]) == (10, 40, "b1", 1)
    assert oom["log_level"] == "error" and oom["splits"] == 2


def test_the_split_is_remembered_and_relaxed_after_good_steps(heads):
    signal = resolve_signal(CFG, heads)
    model = train(replace(CFG, max_steps=0), heads, []).model
    params = list(model.parameters())
    splitter = StepSplitter(params, CPU, relax_after=2, inject=OomInjection(above_tokens=60))
    batches = [random_batch(heads.spec, LAYERS, [25, 25, 26, 9], seed=i, sample_start=10 * i) for i in range(4)]
    with capture_logs() as logs:
        for step, b in enumerate(batches, 1):
            for p in params:
                p.grad = None
            stats = forward_backward(model, heads, b, signal, seed=0, step=step, splitter=splitter)
            assert stats.weight > 0 and stats.blocks > 0
    seen = [(e["event"], e["step"], e["splits"]) for e in logs]
    assert seen == [("train.oom_split", 1, 2),  # 85 tokens fail, 2 x ~43 pass
                    ("train.oom_relax", 3, 1),  # 2 good steps: try the whole batch again
                    ("train.oom_split", 3, 2)]  # still too large: back to 2
    assert splitter.ooms == 2 and splitter.heartbeat() == {"oom_backoff": True, "ooms": 2, "micro_batches": 2}


def test_a_transient_oom_ends_the_backoff(heads):
    signal = resolve_signal(CFG, heads)
    model = train(replace(CFG, max_steps=0), heads, []).model
    splitter = StepSplitter(list(model.parameters()), CPU, relax_after=1, inject=OomInjection(60, times=1))
    b = random_batch(heads.spec, LAYERS, [25, 25, 26, 9], seed=0)
    with capture_logs():
        for step in (1, 2, 3):
            forward_backward(model, heads, b, signal, seed=0, step=step, splitter=splitter)
    assert splitter.heartbeat() == {"oom_backoff": False, "ooms": 1, "micro_batches": 1}


def test_a_real_cpu_allocator_failure_counts_as_oom():
    with pytest.raises(RuntimeError) as err:
        torch.empty(2**48, dtype=torch.uint8)  # 256 TiB: more than any address space here
    assert is_oom(err.value) and bytes_asked(err.value) == 2**48
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_oom(RuntimeError("shape mismatch"))


def test_the_injection_reads_the_environment(monkeypatch):
    monkeypatch.delenv("DFLASH_TEST_OOM_TOKENS", raising=False)
    assert OomInjection.from_env() is None
    monkeypatch.setenv("DFLASH_TEST_OOM_TOKENS", "100")
    monkeypatch.setenv("DFLASH_TEST_OOM_TIMES", "3")
    with capture_logs() as logs:
        assert OomInjection.from_env() == OomInjection(100, 3)
    assert logs[0]["event"] == "train.oom_injection" and logs[0]["log_level"] == "warning"
    monkeypatch.setenv("DFLASH_TEST_OOM_TOKENS", "lots")
    with pytest.raises(ValueError, match="DFLASH_TEST_OOM_TOKENS='lots'"):
        OomInjection.from_env()
