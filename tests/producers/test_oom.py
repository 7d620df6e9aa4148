"""OOM: split the batch and retry; a single sequence that cannot fit is named, skipped and
reported, never a crash. The failure is injected by a hand-written wrapper around the real
capture that raises torch.OutOfMemoryError like the CUDA allocator does."""

from __future__ import annotations

import torch
from structlog.testing import capture_logs

from dflash.producers.capture_oom import OomSplitter
from dflash.protocol.batch import Batch
from dflash.runtime.memory import bytes_asked
import pytest

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


class OomAbove:
    """Real capture, except batches of more than `limit` tokens raise an OOM (`times` times)."""

    def __init__(self, target, limit: int, times: int = 1_000_000):
        self.target, self.limit, self.times = target, limit, times
        self.calls: list[int] = []

    def __call__(self, b: Batch) -> torch.Tensor:
        self.calls.append(b.tokens)
        if b.tokens > self.limit and self.times > 0:
            self.times -= 1
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 4.74 GiB. GPU 5 has a total capacity of 94.97 GiB")
        return self.target.capture(b.input_ids.long(), b.position_ids())


def _batch(lens: list[int], vocab: int) -> Batch:
    """Samples 0..n-1 packed in this order."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (sum(lens),), generator=g, dtype=torch.int32)
    return Batch.packed(list(range(len(lens))), lens, ids, torch.ones(sum(lens), dtype=torch.uint8), lease=3)


def test_oom_on_first_try_splits_and_retries(target):
    batch = _batch([20, 30, 25, 15], target.info.vocab_size)
    fake = OomAbove(target, limit=batch.tokens - 1, times=1)  # fails the first (full) pass only
    splitter = OomSplitter(fake, CPU)
    with capture_logs() as logs:
        outs = list(splitter.run(batch))
    assert fake.calls == [90, 50, 40]  # the whole batch, then its two halves (Batch.split(2))
    assert [o.batch.samples for o in outs] == [[0, 1], [2, 3]] and all(o.skipped is None for o in outs)
    whole = target.capture(batch.input_ids.long(), batch.position_ids())
    torch.testing.assert_close(torch.cat([o.hidden for o in outs]), whole, rtol=0, atol=1e-5)
    (oom,) = [e for e in logs if e["event"] == "produce.oom"]
    assert oom["tokens"] == 90 and oom["seqs"] == 4 and oom["action"] == "split"
    assert oom["bytes_asked"] == int(4.74 * (1 << 30)) and oom["device"] == "cpu"
    assert oom["bytes_free"] is None or oom["bytes_free"] > 0
    assert splitter.ooms == 1 and splitter.backoff_tokens == 90


def test_single_sequence_that_cannot_fit_is_skipped_and_named(target):
    batch = _batch([12, 70, 9], target.info.vocab_size)
    splitter = OomSplitter(OomAbove(target, limit=40), CPU)
    with capture_logs() as logs:
        outs = list(splitter.run(batch))
    produced = [s for o in outs if o.batch for s in o.batch.samples]
    skipped = [o.skipped for o in outs if o.skipped]
    assert produced == [0, 2]
    assert skipped == [(1, "oom: 70 tokens do not fit on cpu")]
    assert any(e["event"] == "produce.skip" and e["sample"] == 1 for e in logs)
    assert splitter.skipped == 1


def test_backoff_splits_large_batches_up_front_then_relaxes(target):
    fake = OomAbove(target, limit=50)
    splitter = OomSplitter(fake, CPU, relax_after=5)
    list(splitter.run(_batch([30, 30, 30, 30], target.info.vocab_size)))  # 120, 60 fail; 4 x 30 pass
    assert fake.calls == [120, 60, 30, 30, 30, 30]  # the second 60 was split up front
    assert splitter.backoff_tokens == 60
    fake.calls.clear()
    list(splitter.run(_batch([35, 35], target.info.vocab_size)))
    assert fake.calls == [35, 35]  # 70 >= 60: split before trying, no second OOM
    assert splitter.ooms == 2 and splitter.backoff_tokens is None  # relaxed after 5 good passes


def test_bytes_asked_parses_torch_messages():
    assert bytes_asked(RuntimeError("Tried to allocate 20.00 MiB (GPU 0")) == 20 << 20
    assert bytes_asked(RuntimeError("something else")) is None
