"""protocol/batch.py's `Batch`, the one batch type from packing to step: the codec decodes
the wire straight into it (tensors zero-copy views of the frames), `owned` gives it
tensors of its own to train on, and `select` and `split` (both OOM paths' one rule) keep
whole sequences."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dflash.protocol import codec
from dflash.protocol.batch import Batch
from dflash.protocol.fp8 import ENCODING, encode_fp8

pytestmark = pytest.mark.unit

RUN = "20261207T000000Z-batch"


def made(lens: list[int], width: int = 8, seed: int = 0, **kw) -> Batch:
    """A batch made here of sequences `lens` (samples 5, 6, ...), float32 hidden states."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    return Batch.packed(list(range(5, 5 + len(lens))), lens, torch.randint(0, 100, (T,), generator=g, dtype=torch.int32),
                        torch.randint(0, 2, (T,), generator=g, dtype=torch.uint8), torch.randn(T, width, generator=g),
                        batch_id="p1-3", producer="p1", lease=4, epoch=2, layer_ids=[1, 2], **kw)


def framed(b: Batch, fp8: bool = False) -> list[bytes]:
    tensors = dict(b.tensors, hidden=b.hidden.to(torch.bfloat16))
    encoding = None
    if fp8:
        q, scale = encode_fp8(b.hidden, len(b.layer_ids))
        tensors.update(hidden=q, hidden_scale=scale)
        encoding = ENCODING
    sent = Batch(b.batch_id, b.producer, b.lease, b.epoch, b.samples, b.seq_lens, b.layer_ids, encoding,
                 tensors=tensors)
    return [bytes(f) for f in codec.encode_batch(sent, RUN)]


def _inside(t: torch.Tensor, frame: bytes) -> bool:
    base = memoryview(frame)
    start = torch.frombuffer(base, dtype=torch.uint8).data_ptr() if len(frame) else 0
    return start <= t.data_ptr() < start + len(frame)


def test_the_codec_decodes_a_batch_once_into_its_one_type_with_zero_copy_tensors():
    b = made([3, 4])
    frames = framed(b)
    got = codec.decode_batch(frames, run=RUN)
    assert type(got) is Batch and got.fields() == b.fields() and got.frames == frames
    assert list(got.tensors) == ["input_ids", "loss_mask", "hidden"]
    # views of the very frames: nothing copied on the way in
    assert all(_inside(t, f) for t, f in zip(got.tensors.values(), frames[1:]))
    assert torch.equal(got.input_ids, b.input_ids) and torch.equal(got.hidden, b.hidden.to(torch.bfloat16))
    relayed = codec.decode_batch(frames, run=RUN, views=False)  # as the broker checks it: no tensor made
    assert relayed.fields() == b.fields() and relayed.tensors == {} and relayed.frames == frames


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_owned_copies_off_the_frames_and_dequantises(fp8):
    b = made([3, 4])
    frames = framed(b, fp8)
    read = codec.decode_batch(frames, run=RUN)
    own = read.owned(torch.float32)
    assert own.fields() == {**b.fields()} and own.hidden_encoding is None and own.frames == []
    assert list(own.tensors) == ["input_ids", "loss_mask", "hidden"]  # hidden_scale was the wire's
    assert not any(_inside(t, f) for t in own.tensors.values() for f in frames[1:])
    assert own.hidden.dtype == torch.float32
    tol = dict(rtol=0.07, atol=0.05) if fp8 else dict(rtol=0.01, atol=0.01)
    assert torch.allclose(own.hidden, b.hidden, **tol)
    own.hidden.add_(1.0)  # its own: the frame keeps what came
    assert torch.equal(read.hidden_as(torch.float32), codec.decode_batch(frames, run=RUN).hidden_as(torch.float32))


def test_select_keeps_whole_sequences_and_their_host_facts():
    b = made([5, 7, 3]).with_host_facts(torch.arange(15, dtype=torch.int32), torch.ones(15, dtype=torch.uint8))
    assert b.id_range == (0, 14)
    s = b.select([0, 2])
    assert (s.batch_id, s.lease, s.epoch, s.samples, s.seq_lens, s.tokens) == ("p1-3", 4, 2, [5, 7], [5, 3], 8)
    rows = list(range(5)) + list(range(12, 15))
    for name, t in b.tensors.items():
        assert torch.equal(s.tensors[name], t[rows]), name
    assert s.host_input_ids.tolist() == rows and s.id_range is None and s.plan is None
    middle = b.select([1])  # consecutive: views, not copies
    assert middle.hidden.data_ptr() == b.hidden[5:].data_ptr() and middle.tokens == 7


def test_split_cuts_consecutive_whole_sequences_of_balanced_size():
    b = made([10, 50, 10, 10, 20])
    for k, want in [(1, [[10, 50, 10, 10, 20]]), (2, [[10, 50], [10, 10, 20]]),
                    (3, [[10], [50, 10], [10, 20]]), (5, [[10], [50], [10], [10], [20]]),
                    (9, [[10], [50], [10], [10], [20]])]:
        parts = b.split(k)
        assert [p.seq_lens for p in parts] == want, k
        assert [s for p in parts for s in p.samples] == b.samples
        assert {(p.batch_id, p.lease, p.epoch) for p in parts} == {("p1-3", 4, 2)}
        for name, t in b.tensors.items():
            assert torch.equal(torch.cat([p.tensors[name] for p in parts]), t), (k, name)
    assert b.split(1)[0] is b  # with what was made for it (a consumer's step plan)
    assert b.split(2)[1].hidden.data_ptr() == b.hidden[60:].data_ptr()  # a view, not a copy


def test_a_packed_batch_has_no_hidden_states_yet_and_splits_the_same_way():
    packed = Batch.packed([0, 1, 2], [20, 30, 25], torch.zeros(75, dtype=torch.int32), torch.ones(75, dtype=torch.uint8),
                          lease=3)
    assert list(packed.tensors) == ["input_ids", "loss_mask"] and packed.final_hidden is None
    assert [p.seq_lens for p in packed.split(2)] == [[20, 30], [25]]
    assert packed.position_ids().tolist()[18:22] == [18, 19, 0, 1]


_FRESH = r"""
import json, sys
from dflash.protocol import codec
from dflash.protocol.batch import Batch
print(json.dumps([m for m in ("torch", "zmq") if m in sys.modules]))
"""


def test_the_codec_and_the_batch_import_neither_torch_nor_zeromq():
    out = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []
