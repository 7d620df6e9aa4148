"""The one codec: msgpack header frame + raw little-endian tensor frames, zero-copy.

Tensors go out as their own frames and come back as ``torch.frombuffer`` views of the received
frames. Every decode validates first (docs/PROTOCOL.md "Validation"): a well-formed message or a
`ProtocolError`. Validation needs no torch, so the broker relays without importing it.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import msgpack

from .batch import Batch
from .errors import ProtocolError
from .fp8 import ENCODING as FP8_ENCODING
from .messages import DATA, MAX_HEADER_BYTES, MAX_MESSAGE_BYTES, MAX_NDIM, MAX_TENSORS, MESSAGES, PRE_HANDSHAKE
from dflash.protocol.fields import PROTOCOL_VERSION

if TYPE_CHECKING:
    import torch

if sys.byteorder != "little":  # pragma: no cover - every supported platform is LE
    raise ImportError("dflash wire format is little-endian; big-endian hosts unsupported")

# The dtype whitelist: wire name (torch's own) -> bytes per element.
ITEMSIZES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
_MAX_DIM = 2**40
_TORCH = None  # (torch, DTYPES, DTYPE_NAMES) once something needs a tensor


def _torch():
    global _TORCH
    if _TORCH is None:
        import torch

        dtypes = {name: getattr(torch, name) for name in ITEMSIZES}
        _TORCH = torch, dtypes, {v: k for k, v in dtypes.items()}
    return _TORCH


def __getattr__(name: str):
    """DTYPES, DTYPE_NAMES, HIDDEN_DTYPES: made when first asked for, so importing the codec skips torch."""
    if name in ("DTYPES", "DTYPE_NAMES"):
        return _torch()[1 if name == "DTYPES" else 2]
    if name == "HIDDEN_DTYPES":
        return tuple(_torch()[1][n] for n in HIDDEN_NAMES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class Message:
    """A decoded message. `tensors` are views into `frames`, which must stay alive."""

    header: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    frames: list = field(default_factory=list, repr=False)

    @property
    def type(self) -> str:
        return self.header["type"]

    def payload_bytes(self) -> int:
        return sum(_frame_len(f) for f in self.frames[1:])


# ---------------------------------------------------------------- encode


def tensor_frame(t: torch.Tensor) -> memoryview:
    """The raw bytes of `t` as a buffer sharing its memory (copies only if non-contiguous)."""
    torch = _torch()[0]
    if t.device.type != "cpu":
        raise ValueError(f"tensor on {t.device}: move it to CPU before sending")
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    # a uint8 view (numpy has no bf16/fp8); the array keeps `t`'s storage alive until ZeroMQ is done
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def encode(header: dict, tensors: Mapping[str, torch.Tensor] | None = None) -> list:
    """Frames for `header` plus `tensors` (in the mapping's order). Adds `tensors` specs."""
    h = dict(header)
    frames: list = [b""]
    if tensors:
        dtype_names = _torch()[2]
        specs = []
        for name, t in tensors.items():
            if t.dtype not in dtype_names:
                raise ValueError(f"tensor {name!r}: dtype {t.dtype} is not on the wire whitelist")
            specs.append({"name": name, "dtype": dtype_names[t.dtype], "shape": list(t.shape)})
            frames.append(tensor_frame(t))
        h["tensors"] = specs
    frames[0] = msgpack.packb(h, use_bin_type=True)
    return frames


def encode_batch(batch: Batch, run: str) -> list:
    """The frames of `batch` in run `run`: its header, then its tensors' bytes as they are."""
    return encode(batch.to_header(run), batch.tensors)


def send(sock, header: dict, tensors: Mapping[str, torch.Tensor] | None = None, flags: int = 0):
    """Send one message; large frames go without a copy (pyzmq copies small ones itself)."""
    from .sockets import send_frames

    send_frames(sock, encode(header, tensors), flags)


# ---------------------------------------------------------------- decode


def payload_bytes(frames: list) -> int:
    """Tensor bytes of an encoded message: every frame after the header."""
    return sum(_frame_len(f) for f in frames[1:])


def _frame_len(f) -> int:
    """Bytes in a frame: a zmq.Frame or bytes (len), or a buffer (its nbytes)."""
    if isinstance(f, memoryview):
        return f.nbytes
    if isinstance(f, bytes) or hasattr(f, "more"):  # zmq.Frame: len is its size, no view made
        return len(f)
    return memoryview(f).nbytes


def _frame_buffer(f) -> memoryview:
    return f.buffer if hasattr(f, "buffer") else memoryview(f)


def _refuse_ext(code, data):
    raise ProtocolError(f"msgpack extension type {code} is not allowed in a header")


def unpack_header(raw) -> dict:
    """Parse frame 0. Raises ProtocolError on anything but a bounded msgpack map."""
    buf = _frame_buffer(raw)
    if buf.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header is {buf.nbytes} bytes, limit {MAX_HEADER_BYTES}")
    try:
        h = msgpack.unpackb(buf, raw=False, strict_map_key=True, ext_hook=_refuse_ext)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises many types for garbage
        raise ProtocolError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(h, dict):
        raise ProtocolError(f"header is a msgpack {type(h).__name__}, not a map")
    return h


def check_header(h: dict, *, allowed: frozenset[str] | None = None, run: str | None = None) -> None:
    """Validate version, type, required fields and run ID of a parsed header."""
    v = h.get("v")
    if v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {v!r} unsupported (this side speaks {PROTOCOL_VERSION})")
    t = h.get("type")
    if not isinstance(t, str) or t not in MESSAGES:
        raise ProtocolError(f"unknown message type {t!r}")
    if allowed is not None and t not in allowed:
        raise ProtocolError(f"message type {t!r} not accepted on this socket")
    MESSAGES[t].check(h)
    if t not in PRE_HANDSHAKE:
        if not isinstance(h.get("run"), str):
            raise ProtocolError(f"{t}: missing run ID")
        if run is not None and h["run"] != run:
            raise ProtocolError(f"{t}: run ID {h['run']!r} is not this run ({run})")


def _tensor_specs(h: dict, n_frames: int) -> list[tuple[str, str, tuple[int, ...], int]]:
    """(name, wire dtype, shape, bytes) of each declared tensor (PROTOCOL.md section 3, step 5)."""
    specs = h.get("tensors", [])
    if not isinstance(specs, list):
        raise ProtocolError("'tensors' is not a list")
    if len(specs) > MAX_TENSORS:
        raise ProtocolError(f"{len(specs)} tensors, limit {MAX_TENSORS}")
    if len(specs) != n_frames:
        raise ProtocolError(f"header describes {len(specs)} tensors but {n_frames} frames follow")
    out, total, names = [], 0, set()
    for i, s in enumerate(specs):
        if not isinstance(s, dict):
            raise ProtocolError(f"tensor spec {i} is not a map")
        name, dtype, shape = s.get("name"), s.get("dtype"), s.get("shape")
        if not isinstance(name, str) or name in names:
            raise ProtocolError(f"tensor spec {i}: bad or duplicate name {name!r}")
        names.add(name)
        itemsize = ITEMSIZES.get(dtype, 0) if isinstance(dtype, str) else 0  # a list is unhashable
        if not itemsize:
            raise ProtocolError(f"tensor {name!r}: dtype {dtype!r} not on the whitelist")
        nbytes = _shape_elements(shape)
        if nbytes < 0:
            raise ProtocolError(f"tensor {name!r}: bad shape {shape!r}")
        nbytes *= itemsize
        total += nbytes
        if total > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"tensors declare {total} bytes, limit {MAX_MESSAGE_BYTES}")
        out.append((name, dtype, tuple(shape), nbytes))
    return out


def _shape_elements(shape) -> int:
    """Elements of a valid shape (at most MAX_NDIM plain ints in 0..2**40; a bool is not one), else -1."""
    if shape.__class__ is not list or len(shape) > MAX_NDIM:
        return -1
    n = 1
    for d in shape:
        if d.__class__ is not int or not 0 <= d < _MAX_DIM:
            return -1
        n *= d
    return n


# Received tensors are read-only by rule, so torch's warning says nothing; one global filter, as
# catch_warnings() per view is slow and not thread-safe.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def _view(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    torch = _TORCH[0]  # decode called _torch()
    if buf.nbytes == 0:  # torch.frombuffer refuses empty buffers
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def decode(
    frames: Sequence[Any],
    *,
    allowed: frozenset[str] | None = None,
    run: str | None = None,
    peer: str | None = None,
    views: bool = True,
    parsed: dict | None = None,
) -> Message:
    """Validate and decode a multipart message; raises ProtocolError (with `peer`). `views=False` checks
    as much but makes no tensor views (the broker relays unread); `parsed`: frame 0 already parsed."""
    h, tensors = _checked(frames, allowed, run, peer, views, parsed)
    return Message(h, tensors, list(frames))


def decode_batch(frames: Sequence[Any], *, run: str | None = None, peer: str | None = None,
                 views: bool = True, parsed: dict | None = None) -> Batch:
    """A `batch` message, checked as `decode` checks it, as a `Batch` keeping `frames`."""
    h, tensors = _checked(frames, DATA, run, peer, views, parsed)
    try:
        return Batch.from_header(h, tensors=tensors, frames=list(frames))
    except ProtocolError as e:
        e.peer = e.peer or peer
        raise


def _checked(frames: Sequence[Any], allowed: frozenset[str] | None, run: str | None, peer: str | None,
             views: bool, parsed: dict | None) -> tuple[dict, dict]:
    """(header, tensors by name) of a valid message; every refusal a ProtocolError naming `peer`."""
    try:
        if not frames:
            raise ProtocolError("empty message")
        h = unpack_header(frames[0]) if parsed is None else parsed
        check_header(h, allowed=allowed, run=run)
        specs = _tensor_specs(h, len(frames) - 1)
        tensors, shapes = {}, {}
        dtypes = _torch()[1] if views and specs else None
        for (name, dtype, shape, nbytes), f in zip(specs, frames[1:]):
            size = _frame_len(f)
            if size != nbytes:
                raise ProtocolError(f"tensor {name!r}: frame has {size} bytes, shape says {nbytes}")
            shapes[name] = (dtype, shape)
            if views:
                tensors[name] = _view(_frame_buffer(f), dtypes[dtype], shape)
        if h["type"] == "batch":
            check_batch(h, shapes)
        return h, tensors
    except ProtocolError as e:
        e.peer = e.peer or peer
        raise


def recv(sock, *, allowed=None, run=None, peer=None, flags: int = 0) -> Message:
    """Receive and decode one message without copying its frames."""
    from .sockets import recv_frames

    return decode(recv_frames(sock, flags), allowed=allowed, run=run, peer=peer)


# ---------------------------------------------------------------- batch rules

HIDDEN_NAMES = ("bfloat16", "float16", "float32", "float8_e4m3fn")


def check_batch(h: dict, t: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
    """A batch's tensors (`t`: name -> (wire dtype, shape)) agree with each other and its header."""
    for name in ("input_ids", "loss_mask", "hidden"):
        if name not in t:
            raise ProtocolError(f"batch: missing tensor {name!r}")
    (ids_t, ids), (mask_t, mask), (hid_t, hid) = (t[n] for n in ("input_ids", "loss_mask", "hidden"))
    if ids_t != "int32" or len(ids) != 1:
        raise ProtocolError(f"batch: input_ids must be int32 [T], got torch.{ids_t} {list(ids)}")
    T = ids[0]
    if mask_t != "uint8" or tuple(mask) != (T,):
        raise ProtocolError(f"batch: loss_mask must be uint8 [{T}], got torch.{mask_t} {list(mask)}")
    if hid_t not in HIDDEN_NAMES or len(hid) != 2 or hid[0] != T:
        raise ProtocolError(f"batch: hidden must be [{T}, n_layers*H] float, got torch.{hid_t} {list(hid)}")
    seq_lens, samples, layers = h["seq_lens"], h["samples"], h["layer_ids"]
    if not all(isinstance(x, int) and x > 0 for x in seq_lens) or sum(seq_lens) != T:
        raise ProtocolError(f"batch: seq_lens must be positive ints summing to T={T}")
    if len(samples) != len(seq_lens) or not all(isinstance(s, int) for s in samples):
        raise ProtocolError("batch: samples and seq_lens differ in length or samples are not ints")
    if not layers or not all(isinstance(x, int) and x >= 0 for x in layers):
        raise ProtocolError("batch: layer_ids must be a non-empty list of non-negative ints")
    if hid[1] % len(layers):
        raise ProtocolError(f"batch: hidden width {hid[1]} not a multiple of {len(layers)} layers")
    if hid_t == "float8_e4m3fn":
        sc_t, sc_shape = t.get("hidden_scale", (None, None))
        if sc_t != "float32" or sc_shape != (T, len(layers)):
            raise ProtocolError(f"batch: fp8 hidden needs float32 hidden_scale [{T}, {len(layers)}]")
    encoding = h.get("hidden_encoding") or "raw"
    if (hid_t == "float8_e4m3fn") != (encoding == FP8_ENCODING):
        # a receiver decodes by the header's word: the other pairing crashes it or trains on noise
        raise ProtocolError(f"batch: hidden_encoding {str(encoding)[:40]!r} does not fit hidden of torch.{hid_t} "
                            f"({FP8_ENCODING} is float8_e4m3fn with hidden_scale, raw is bf16/fp16/fp32)")
    if "final_hidden" in t:  # optional: the target's LM-head input, for distillation (PROTOCOL.md)
        fin_t, fin = t["final_hidden"]
        D = hid[1] // len(layers)
        if fin_t not in HIDDEN_NAMES[:3] or tuple(fin) != (T, D):
            raise ProtocolError(f"batch: final_hidden must be [{T}, {D}] bf16/fp16/fp32, got torch.{fin_t} {list(fin)}")

