import pytest
import torch

from dflash.protocol import codec
from dflash.protocol.errors import ProtocolError
from dflash.protocol.codec import FP8_ENCODING as ENCODING
from dflash.protocol.fp8 import decode_fp8, encode_fp8, hidden_from_batch

pytestmark = pytest.mark.unit


def test_fp8_rowscale_roundtrip_error_is_small_and_relative():
    torch.manual_seed(0)
    T, n, H = 37, 3, 64
    # rows of very different magnitudes: a per-tensor scale would crush the small ones
    h = torch.randn(T, n * H) * torch.logspace(-3, 3, T).unsqueeze(1)
    q, s = encode_fp8(h, n)
    assert q.dtype == torch.float8_e4m3fn and q.shape == h.shape and s.shape == (T, n)
    back = decode_fp8(q, s, torch.float32)
    rel = ((back - h).norm(dim=1) / h.norm(dim=1)).max()
    assert rel < 0.05, rel  # e4m3 has a 3-bit mantissa: ~2-3% relative error per row


def test_fp8_batch_travels_through_codec_and_halves_bytes():
    T, n, H = 16, 5, 128
    hidden = torch.randn(T, n * H).to(torch.bfloat16)
    q, s = encode_fp8(hidden, n)
    h = {"v": 1, "type": "batch", "run": "20261129T000000Z-abcd", "batch_id": "p1-0", "producer": "p1",
         "lease": 0, "epoch": 0, "samples": [0], "seq_lens": [T], "layer_ids": [1, 2, 3, 4, 5],
         "hidden_encoding": ENCODING}
    tensors = {"input_ids": torch.zeros(T, dtype=torch.int32), "loss_mask": torch.ones(T, dtype=torch.uint8),
               "hidden": q, "hidden_scale": s}
    out = hidden_from_batch(codec.decode_batch(codec.encode(h, tensors)), torch.float32)
    assert torch.allclose(out, hidden.float(), rtol=0.07, atol=1e-2)
    assert q.numel() * 1 + s.numel() * 4 < 0.55 * hidden.numel() * 2


@pytest.mark.parametrize("views", [True, False])  # False: the broker's check, without tensor views
def test_an_fp8_batch_without_its_row_scales_is_refused(views):
    T, n, H = 8, 2, 16
    q, s = encode_fp8(torch.randn(T, n * H).to(torch.bfloat16), n)
    h = {"v": 1, "type": "batch", "run": "20261129T000000Z-abcd", "batch_id": "p1-0", "producer": "p1",
         "lease": 0, "epoch": 0, "samples": [0], "seq_lens": [T], "layer_ids": [1, 2], "hidden_encoding": ENCODING}
    base = {"input_ids": torch.zeros(T, dtype=torch.int32), "loss_mask": torch.ones(T, dtype=torch.uint8), "hidden": q}
    for scale in (None, s[:, :1].contiguous(), s.to(torch.float16)):  # missing, wrong shape, wrong dtype
        tensors = base if scale is None else {**base, "hidden_scale": scale}
        with pytest.raises(ProtocolError, match="hidden_scale"):
            codec.decode(codec.encode(h, tensors), views=views)
    assert codec.decode(codec.encode(h, {**base, "hidden_scale": s}), views=views).header["batch_id"] == "p1-0"
