"""The codec: every dtype and shape round-trips exactly through real ZeroMQ sockets, the
frame count is what PROTOCOL.md says, and a large received frame is not copied."""

from __future__ import annotations

import tracemalloc

import msgpack
import numpy as np
import pytest
import torch
import zmq

from dflash.protocol import codec
from dflash.protocol.errors import ProtocolError
from dflash.protocol.fields import header

pytestmark = pytest.mark.integration


@pytest.fixture
def pair():
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (pull, push):
        s.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    yield push, pull
    push.close()
    pull.close()


def _sample(dtype: torch.dtype, shape) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape) * 3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, dtype=dtype)


@pytest.mark.parametrize("dtype", list(codec.DTYPES.values()), ids=list(codec.DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (5, 12)], ids=["0d", "empty", "empty3d", "1d", "2d"])
def test_every_dtype_and_shape_round_trips_bit_exact(pair, dtype, shape):
    push, pull = pair
    t = _sample(dtype, shape)
    codec.send(push, header("heartbeat", "r", stats={}), {"t": t})
    frames = pull.recv_multipart(copy=False)
    assert len(frames) == 2  # header + one frame per tensor
    msg = codec.decode(frames)
    got = msg.tensors["t"]
    assert got.dtype == dtype and tuple(got.shape) == shape
    # compare bytes, so NaN and -0.0 count too, and bf16/fp8 bits are checked exactly
    assert got.reshape(-1).view(torch.uint8).tolist() == t.reshape(-1).view(torch.uint8).tolist()


def test_non_contiguous_and_several_tensors_keep_order_and_values(pair):
    push, pull = pair
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    tensors = {"transposed": base.t(), "strided": base[:, ::3], "bf16": base.to(torch.bfloat16)[1:4]}
    assert not tensors["transposed"].is_contiguous()
    codec.send(push, header("heartbeat", "r", stats={}), tensors)
    msg = codec.recv(pull)
    assert list(msg.tensors) == list(tensors) and len(msg.frames) == 4
    for name, t in tensors.items():
        assert torch.equal(msg.tensors[name], t)


def test_large_received_frame_is_not_copied(pair):
    push, pull = pair
    n = 64 << 20  # 64 MiB of bf16
    big = torch.ones(n // 2, dtype=torch.bfloat16)
    codec.send(push, header("heartbeat", "r", stats={}), {"hidden": big})
    frames = pull.recv_multipart(copy=False)
    tracemalloc.start()
    try:
        msg = codec.decode(frames)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    got = msg.tensors["hidden"]
    buf = frames[1].buffer  # the zmq frame's own memory
    start = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    assert start <= got.data_ptr() < start + buf.nbytes  # the tensor IS the frame
    assert got.numel() * 2 == n
    assert peak < (1 << 20), f"decode allocated {peak} bytes in Python for a {n}-byte frame"


@pytest.mark.parametrize(
    "frames, says",
    [
        ([msgpack.packb({"v": 1, "type": "heartbeat", "run": "r", "stats": {}})[:-2]], "not valid msgpack"),
        ([msgpack.packb([1, 2])], "not a map"),
        ([msgpack.packb({"v": 2, "type": "heartbeat", "run": "r", "stats": {}})], "version"),
        ([msgpack.packb({"v": 1, "type": "nope"})], "unknown message type"),
        ([msgpack.packb({"v": 1, "type": "heartbeat", "stats": {}})], "missing run"),
        ([msgpack.packb({"v": 1, "type": "heartbeat", "run": "r", "stats": {},
                         "tensors": [{"name": "a", "dtype": "int8", "shape": [3]}]}), b"12"], "frame has 2 bytes"),
        ([msgpack.packb({"v": 1, "type": "heartbeat", "run": "r", "stats": {},
                         "tensors": [{"name": "a", "dtype": "int8", "shape": [3]}]})], "1 tensors but 0 frames"),
        ([msgpack.packb({"v": 1, "type": "heartbeat", "run": "r", "stats": {},
                         "tensors": [{"name": "a", "dtype": "int8", "shape": [2**35, 2**35]}]}), b""], "limit"),
        ([msgpack.packb({"v": 1, "type": "heartbeat", "run": "r", "stats": {},
                         "tensors": [{"name": "a", "dtype": "object", "shape": [1]}]}), b"x"], "whitelist"),
        ([msgpack.packb({"v": 1, "type": "heartbeat", "run": "r", "stats": {}, "x": msgpack.ExtType(1, b"")})],
         "extension type"),
    ],
    ids=["truncated", "non-map", "version", "unknown-type", "no-run", "nbytes", "count", "absurd", "dtype", "ext"],
)
def test_decode_refuses_with_a_reason(frames, says):
    with pytest.raises(ProtocolError, match=says) as e:
        codec.decode(frames, peer="p7")
    assert e.value.peer == "p7"


def test_decode_refuses_another_runs_message():
    frames = codec.encode(header("ack", "run-a", batch_ids=[], step=1))
    with pytest.raises(ProtocolError, match="not this run"):
        codec.decode(frames, run="run-b")


def test_frames_helpers_send_and_receive_whole_messages_without_copy(pair):
    """sockets.send_frames / recv_frames (what every relay uses instead of pyzmq's
    *_multipart): parts stay together and in order, large ones arrive as zmq.Frames
    sharing ZeroMQ's memory, and NOBLOCK on an empty socket raises zmq.Again."""
    from dflash.protocol.sockets import recv_frames, send_frames

    push, pull = pair
    big = np.arange(1 << 20, dtype=np.uint8)
    send_frames(push, [b"one"], zmq.NOBLOCK)
    send_frames(push, [b"a", memoryview(big), zmq.Frame(b"c")])
    assert [f.bytes for f in recv_frames(pull)] == [b"one"]
    got = recv_frames(pull)
    assert [len(f) for f in got] == [1, 1 << 20, 1] and all(isinstance(f, zmq.Frame) for f in got)
    assert (got[0].bytes, got[2].bytes) == (b"a", b"c") and got[1].buffer == memoryview(big)
    with pytest.raises(zmq.Again):
        recv_frames(pull, zmq.NOBLOCK)

