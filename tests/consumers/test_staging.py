"""The batch stager (consumers/training/staging.py): the next batch is prepared on a thread, one item
ahead, in order, with the source's errors and end where they happened; and the loop trains
the very same thing with or without it."""

import threading
import time
from dataclasses import replace

import pytest
import torch
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, batch_message, random_batch
from dflash.protocol.batch import Batch
from dflash.consumers.training.config import TrainConfig
from dflash.consumers.training import staging
from dflash.consumers.training.staging import BatchStager
from dflash.consumers.training.train import train

pytestmark = pytest.mark.unit

LAYERS = [1, 2]
CPU = torch.device("cpu")


def _batches(spec, n, lens=(20, 14)):
    return [random_batch(spec, LAYERS, list(lens), seed=i, batch_id=f"p1-{i}", sample_start=len(lens) * i)
            for i in range(n)]


def _same(a: Batch, b: Batch) -> None:
    assert (a.batch_id, a.samples, a.seq_lens, a.layer_ids, a.epoch) == (b.batch_id, b.samples, b.seq_lens,
                                                                           b.layer_ids, b.epoch)
    assert list(a.tensors) == list(b.tensors)
    for x, y in zip(a.tensors.values(), b.tensors.values()):
        assert x.dtype == y.dtype and x.device == y.device and torch.equal(x, y)


class CountingSource:
    """A source that records, for every item it yields, how many items the test had taken by then."""

    def __init__(self, items):
        self.items, self.taken, self.yielded_at = list(items), 0, []

    def __iter__(self):
        for item in self.items:
            self.yielded_at.append(self.taken)
            yield item


def _wait_until(cond, timeout=30.0):  # a deadline, not a speed check
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_items_come_in_order_as_owned_makes_them(heads, dtype):
    src = _batches(heads.spec, 4)
    msgs = [batch_message(src[0]), batch_message(src[1], fp8=True)]
    items = [msgs[0], None, src[2], None, None, msgs[1], src[3]]
    with BatchStager(iter(items), CPU, dtype) as stager:
        got = list(stager)
    assert [g is None for g in got] == [i is None for i in items]
    _same(got[0], msgs[0].owned(dtype))
    _same(got[5], msgs[1].owned(dtype))
    # on CPU a batch made here passes as it is: its very tensors
    assert all(got[i].tensors[k] is b.tensors[k] for i, b in ((2, src[2]), (6, src[3])) for k in b.tensors)
    assert torch.allclose(got[5].hidden.float(), src[1].hidden, rtol=0.07, atol=0.05)  # fp8 dequantised


def test_reads_exactly_one_item_ahead(heads):
    items = [batch_message(b) for b in _batches(heads.spec, 3)] + [None, None]
    source = CountingSource(items)
    stager = BatchStager(source, CPU, torch.float32)
    try:
        time.sleep(0.2)
        assert source.yielded_at == []  # nothing is read before the first next()
        for k in range(len(items)):
            next(stager)
            source.taken = k + 1
            # the thread reads the next item while "the step runs", and no further one
            assert _wait_until(lambda: len(source.yielded_at) == min(k + 2, len(items)))
            time.sleep(0.1)
            assert len(source.yielded_at) == min(k + 2, len(items))
        with pytest.raises(StopIteration):
            next(stager)
    finally:
        stager.close()
    # Item i may be read once i items were taken; `taken` is set just after next() returns,
    # so the read-ahead may see one less: i - taken is 0 or 1, never more.
    assert all(i - taken <= 1 for i, taken in enumerate(source.yielded_at)), source.yielded_at


def test_source_and_conversion_errors_are_raised_at_their_position(heads):
    b = _batches(heads.spec, 3)

    def failing():
        yield batch_message(b[0])
        yield None
        raise ConnectionError("the link broke")

    stager = BatchStager(failing(), CPU, torch.float32)
    assert next(stager).batch_id == "p1-0" and next(stager) is None
    with pytest.raises(ConnectionError, match="the link broke"):
        next(stager)
    with pytest.raises(StopIteration):  # like a generator that raised: finished
        next(stager)
    stager.close()

    stager = BatchStager(iter([batch_message(b[1]), "not a batch", batch_message(b[2])]), CPU, torch.float32)
    assert next(stager).batch_id == "p1-1"
    with pytest.raises(TypeError, match="expected a Batch or None .* got str"):
        next(stager)
    stager.close()


def test_close_returns_promptly_while_the_source_waits(monkeypatch):
    # Asserted on the thread, not on seconds (a loaded machine stretches any bound): with
    # close's wait made far longer than the source's, the thread is gone when close returns
    # only if it ended as soon as the source came back.
    monkeypatch.setattr(staging, "CLOSE_WAIT_S", 120.0)
    back = []

    def slow_none():  # the broker source: None after waiting 0.5 s for a batch
        while True:
            time.sleep(0.5)
            back.append(1)
            yield None

    stager = BatchStager(slow_none(), CPU)
    assert next(stager) is None  # the thread now waits in the source for the next one
    stager.close()
    assert not stager._thread.is_alive() and len(back) <= 2  # not one more source call after close
    with pytest.raises(StopIteration):
        next(stager)

    release, inside = threading.Event(), threading.Event()

    def stuck():  # a source that does not come back at all until released
        yield None
        inside.set()
        release.wait()
        yield None

    monkeypatch.setattr(staging, "CLOSE_WAIT_S", 0.1)
    stager = BatchStager(stuck(), CPU)
    assert next(stager) is None
    assert inside.wait(60)  # the thread is in the source now
    stager.close()  # gives up waiting for the thread, does not hang
    assert stager._thread.is_alive()  # it returned with the thread still stuck in the source
    release.set()
    assert _wait_until(lambda: not stager._thread.is_alive())  # it ends once the source returns


def test_staged_batches_never_touch_the_frames(heads):
    src = _batches(heads.spec, 2)
    msgs = [batch_message(src[0]), batch_message(src[1], fp8=True)]
    before = [_frame_bytes(m) for m in msgs]
    with BatchStager(iter(msgs), CPU, torch.bfloat16) as stager:
        staged = list(stager)
    for m, b in zip(msgs, staged):
        frame_views = list(m.tensors.values())
        for t in b.tensors.values():
            assert all(not _overlaps(t, v) for v in frame_views)
            if t.dtype == torch.uint8:
                t.bitwise_not_()
            else:
                t.add_(1)
    assert all(all(torch.equal(x, y) for x, y in zip(_frame_bytes(m), b)) for m, b in zip(msgs, before))


def _frame_bytes(m) -> list[torch.Tensor]:
    """A copy of the bytes of each frame (the link's tensors are views of them)."""
    return [t.reshape(-1).view(torch.uint8).clone() for t in m.tensors.values()]


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(draft_layers=2, target_layers=tuple(LAYERS), block_size=4, anchors=4, mask_token_id=MASK_ID,
                       log_position_every=0, **kw)


def test_the_loop_trains_the_same_with_and_without_staging(heads):
    src = _batches(heads.spec, 4)
    msgs = [batch_message(b, fp8=i % 2 == 1) for i, b in enumerate(src)]
    items = [msgs[0], None, src[1], msgs[1], msgs[2], src[3], msgs[3]]
    runs = {}
    for stage in (True, False):
        with capture_logs() as logs:
            state = train(_cfg(stage_batches=stage), heads, iter(items))
        runs[stage] = (state, [e["loss"] for e in logs if e["event"] == "train.step"])
    (staged, staged_loss), (plain, plain_loss) = runs[True], runs[False]
    assert staged.step == plain.step == 6 and staged_loss == plain_loss
    for p, q in zip(staged.model.parameters(), plain.model.parameters()):
        assert torch.equal(p, q)
    assert not any(t.name == "dflash-stager" for t in threading.enumerate())  # closed with the loop


def test_a_stopped_loop_leaves_the_read_ahead_batch_untrained(heads):
    src = _batches(heads.spec, 3)
    source = CountingSource([batch_message(b) for b in src])
    state = train(replace(_cfg(), max_steps=1), heads, iter(source))
    assert state.step == 1 and state.samples == 2  # one batch trained
    assert len(source.yielded_at) <= 2  # the step's batch and at most one staged


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_copies_to_the_device_and_equals_the_cpu_path(heads):
    dev = torch.device("cuda", torch.cuda.current_device())
    src = _batches(heads.spec, 3, lens=(300, 200, 100))
    items = [batch_message(src[0]), None, batch_message(src[1], fp8=True), src[2]]
    with BatchStager(iter(items), dev, torch.bfloat16) as stager:
        got = list(stager)
    assert got[1] is None
    for g, want in ((got[0], items[0].owned()), (got[2], items[2].owned()), (got[3], src[2])):
        assert all(t.device == dev for t in g.tensors.values())
        _same(g.to(CPU), want)  # fp8 dequantised on the GPU == dequantised on the CPU, bit for bit
    # micro-batching and skip-held selection index the staged tensors on their device
    parts = got[2].split(3)
    assert [p.tokens for p in parts] == [300, 200, 100] and all(p.hidden.is_cuda for p in parts)
    picked = got[2].select([0, 2])
    _same(picked.to(CPU), items[2].owned().select([0, 2]))
