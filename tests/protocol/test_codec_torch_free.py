"""The broker validates and relays without torch: importing its entry module and server,
and the codec's validation path (`decode(views=False)`, `unpack_header`, header-only
`encode`), leave torch out of sys.modules (it costs seconds at every broker start); the
checks by dtype name refuse what the torch dtypes did, with the same messages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dflash.protocol import codec
from dflash.protocol.errors import ProtocolError
from dflash.protocol.fields import header

pytestmark = pytest.mark.unit

# Run in a fresh interpreter: this one has torch already. Frames are built with msgpack
# alone, a batch as the broker's data in receives it, and the refusals it must make.
_BROKER_SIDE = r"""
import json, sys
import msgpack
import dflash.broker.broker_command, dflash.broker.broker_process, dflash.broker.server
from dflash.protocol import codec
from dflash.protocol.errors import ProtocolError

T, W = 4, 8
def batch(ids="int32", hidden_bytes=2 * T * W):
    h = {"v": 1, "type": "batch", "run": "r", "batch_id": "p-0", "producer": "p", "lease": 0, "epoch": 0,
         "samples": [0], "seq_lens": [T], "layer_ids": [1, 2],
         "tensors": [{"name": "input_ids", "dtype": ids, "shape": [T]},
                     {"name": "loss_mask", "dtype": "uint8", "shape": [T]},
                     {"name": "hidden", "dtype": "bfloat16", "shape": [T, W]}]}
    return [msgpack.packb(h), bytes(codec.ITEMSIZES[ids] * T), bytes(T), bytes(hidden_bytes)]

errors = []
assert codec.decode(batch(), run="r", views=False).payload_bytes() == 4 * T + T + 2 * T * W
for frames in (batch(ids="int64"), batch(hidden_bytes=3)):
    try:
        codec.decode(frames, run="r", views=False)
    except ProtocolError as e:
        errors.append(str(e))
hb = codec.encode({"v": 1, "type": "heartbeat", "run": "r", "stats": {},
                   "tensors": [{"name": "a", "dtype": "uint8", "shape": [2]}]})
hb.append(b"xy")  # a control message with a tensor: validated, never viewed
codec.decode(hb, parsed=codec.unpack_header(hb[0]), views=False)
print(json.dumps({"errors": errors, "loaded": [m for m in ("torch", "transformers") if m in sys.modules]}))
"""


def test_broker_imports_and_validation_path_do_not_import_torch():
    out = subprocess.run([sys.executable, "-c", _BROKER_SIDE], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["loaded"] == [], f"the broker's imports pulled in {got['loaded']}"
    assert got["errors"] == ["batch: input_ids must be int32 [T], got torch.int64 [4]",
                             "tensor 'hidden': frame has 3 bytes, shape says 64"]


def test_wire_item_sizes_are_torchs_and_torch_tables_still_there():
    assert list(codec.DTYPES) == list(codec.ITEMSIZES)
    for name, dt in codec.DTYPES.items():
        assert dt == getattr(torch, name) and dt.itemsize == codec.ITEMSIZES[name]
        assert codec.DTYPE_NAMES[dt] == name
    assert codec.HIDDEN_DTYPES == (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


def _batch(**over) -> dict:
    T, W = 6, 16
    t = {"input_ids": torch.zeros(T, dtype=torch.int32), "loss_mask": torch.ones(T, dtype=torch.uint8),
         "hidden": torch.zeros(T, W, dtype=torch.bfloat16)}
    t.update(over)
    return t


@pytest.mark.parametrize(
    "tensors, says",
    [
        (_batch(input_ids=torch.zeros(6, dtype=torch.int64)), r"input_ids must be int32 \[T\], got torch.int64 \[6\]"),
        (_batch(loss_mask=torch.ones(6, dtype=torch.bool)), r"loss_mask must be uint8 \[6\], got torch.bool \[6\]"),
        (_batch(hidden=torch.zeros(6, 16, dtype=torch.int16)),
         r"hidden must be \[6, n_layers\*H\] float, got torch.int16 \[6, 16\]"),
        (_batch(hidden=torch.zeros(6, 16).to(torch.float8_e4m3fn)), r"fp8 hidden needs float32 hidden_scale \[6, 2\]"),
        (_batch(hidden=torch.zeros(6, 16).to(torch.float8_e4m3fn), hidden_scale=torch.ones(6, 2, dtype=torch.float16)),
         r"fp8 hidden needs float32 hidden_scale \[6, 2\]"),
        (_batch(final_hidden=torch.zeros(6, 8).to(torch.float8_e4m3fn)),
         r"final_hidden must be \[6, 8\] bf16/fp16/fp32, got torch.float8_e4m3fn \[6, 8\]"),
    ],
    ids=["ids-int64", "mask-bool", "hidden-int", "fp8-no-scale", "fp8-scale-fp16", "final-fp8"],
)
@pytest.mark.parametrize("views", [False, True], ids=["relay", "views"])
def test_batch_of_real_tensors_refused_for_a_wrong_dtype_with_and_without_views(tensors, says, views):
    h = header("batch", "r", batch_id="p-0", producer="p", lease=0, epoch=0, samples=[0], seq_lens=[6],
               layer_ids=[1, 2])
    with pytest.raises(ProtocolError, match=f"^batch: {says}$"):
        codec.decode(codec.encode(h, tensors), run="r", views=views)


@pytest.mark.parametrize("views", [False, True], ids=["relay", "views"])
def test_batch_of_real_tensors_refused_for_a_wrong_frame_size(views):
    h = header("batch", "r", batch_id="p-0", producer="p", lease=0, epoch=0, samples=[0], seq_lens=[6],
               layer_ids=[1, 2])
    frames = codec.encode(h, _batch())
    msg = codec.decode(frames, run="r", views=views)
    assert msg.payload_bytes() == 6 * 4 + 6 + 6 * 16 * 2 and bool(msg.tensors) is views
    frames[3] = bytes(6 * 16 * 2 - 1)
    with pytest.raises(ProtocolError, match="^tensor 'hidden': frame has 191 bytes, shape says 192$"):
        codec.decode(frames, run="r", views=views)
