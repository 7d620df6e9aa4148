"""Knowledge distillation (--distill-weight): the soft-label loss equals a hand-written
reference on a tiny case, final hidden states cross the wire as an optional tensor, and a
CPU run on a real tiny target's capture trains with it."""

from dataclasses import replace

import pytest
import torch
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, rule_batch
from dflash.consumers.training.batch import BatchMismatch
from dflash.protocol.batch import Batch
from dflash.consumers.drafter.loss import ChunkedCE
from dflash.consumers.training.train import train
from dflash.consumers.training.config import TrainConfig
from dflash.producers.chat import ChatEncoder
from dflash.producers.data import Row
from dflash.producers.packing import pack
from dflash.producers.sample_data import generate_chats
from dflash.producers.target import load_target
from dflash.protocol import codec
from dflash.protocol.errors import ProtocolError
from dflash.protocol.fields import header
from dflash.runtime.targets import load_tokenizer
from dflash.tools.tiny import tiny_target

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_soft_label_loss_and_gradient_equal_a_hand_computed_reference(alpha):
    g = torch.Generator().manual_seed(0)
    Q, D, V = 5, 4, 7
    h = torch.randn(Q, D, generator=g, dtype=torch.float64, requires_grad=True)
    W, t = torch.randn(V, D, generator=g, dtype=torch.float64), torch.randn(Q, D, generator=g, dtype=torch.float64)
    y, w = torch.randint(0, V, (Q,), generator=g), torch.rand(Q, generator=g, dtype=torch.float64)
    loss, preds = ChunkedCE.apply(h, W, y, w, 2, t, alpha)  # chunks of 2 rows: 2 + 2 + 1
    loss.backward()
    got_grad, h.grad = h.grad.clone(), None

    ref = 0.0
    for i in range(Q):  # one row at a time, straight from the definitions
        z, zt = h[i] @ W.T, t[i] @ W.T
        p = torch.exp(z) / torch.exp(z).sum()
        q = torch.exp(zt) / torch.exp(zt).sum()
        ce = -torch.log(p[y[i]])
        kl = (q * (torch.log(q) - torch.log(p))).sum()
        ref = ref + w[i] * ((1 - alpha) * ce + alpha * kl)
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-10) and torch.allclose(got_grad, h.grad, rtol=1e-9, atol=1e-12)
    assert torch.equal(preds, (h @ W.T).argmax(1))
    if alpha == 0:  # no soft labels: exactly the plain chunked CE
        h.grad = None
        plain, _ = ChunkedCE.apply(h, W, y, w, 2)
        assert torch.allclose(plain, loss)


def _tiny_final_batches():
    folder = tiny_target(family="qwen3", layers=4)
    tok = load_tokenizer(folder)
    enc = ChatEncoder(tok, max_length=128)
    rows = [enc.encode(Row(i, "chats", messages=c["messages"])) for i, c in enumerate(generate_chats(4))]
    target = load_target(str(folder), None, device=torch.device("cpu"), dtype="float32", final=True, full=True)
    n_h = len(target.layer_ids) * target.hidden_size
    out = []
    for p in pack(rows, token_budget=256, max_batch_size=2):
        got = target.capture(p.input_ids.long(), p.position_ids())
        out.append(Batch.packed(p.samples, p.seq_lens, p.input_ids, p.loss_mask, got[:, :n_h].clone(),
                                batch_id=f"b{len(out)}", layer_ids=target.layer_ids, final_hidden=got[:, n_h:].clone()))
    return folder, target, out


def test_final_hidden_is_the_lm_heads_input():
    _, target, batches = _tiny_final_batches()
    b = batches[0]
    L = b.seq_lens[0]
    with torch.inference_mode():
        ref = target.model(b.input_ids[:L].long()[None], output_hidden_states=True)
    torch.testing.assert_close(b.final_hidden[:L], ref.hidden_states[-1][0], rtol=1e-5, atol=1e-5)
    # the soft labels the consumer computes are the target's own logits
    torch.testing.assert_close(b.final_hidden[:L] @ target.model.lm_head.weight.T, ref.logits[0], rtol=1e-4,
                               atol=1e-4)


def _with_teacher(b: Batch, lm_head: torch.Tensor) -> Batch:
    """The stride stream with a teacher that knows it: each token's final state points at
    the next token's LM-head row, so the target's distribution peaks on the right label."""
    nxt = torch.cat([b.input_ids[1:], b.input_ids[-1:]]).long()
    return replace(b, tensors={**b.tensors, "final_hidden": 0.05 * lm_head[nxt]})


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_a_distilled_drafter_learns(heads, alpha):
    layers = [1, 2]
    batches = [_with_teacher(rule_batch(heads.spec, layers, seed=i, n_seqs=4, seq_len=24), heads.lm_head)
               for i in range(30)]
    cfg = TrainConfig(draft_layers=1, target_layers=tuple(layers), block_size=4, anchors=8, lr=3e-3,
                      mask_token_id=MASK_ID, distill_weight=alpha, log_position_every=0, save_every=0,
                      total_samples=30 * 4)
    with capture_logs() as logs:
        state = train(cfg, heads, iter(batches))
    losses = [e["loss"] for e in logs if e["event"] == "train.step"]
    assert state.step == 30 and len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, " ".join(str(round(x, 2)) for x in losses)
    assert [e for e in logs if e["event"] == "train.start"][0]["signal"]["distill"] == alpha


def test_distillation_refuses_batches_without_final_hidden(heads):
    cfg = TrainConfig(draft_layers=1, target_layers=(1, 2), block_size=4, anchors=8, mask_token_id=MASK_ID,
                      distill_weight=0.5, log_position_every=0, save_every=0)
    with capture_logs(), pytest.raises(BatchMismatch, match="--final-hidden"):
        train(cfg, heads, iter([rule_batch(heads.spec, [1, 2], seed=0)]))


def test_final_hidden_crosses_the_wire_and_is_required_for_distillation(heads):
    _, _, batches = _tiny_final_batches()
    b = batches[0]
    fields = dict(batch_id="x", producer="p1", lease=0, epoch=0, samples=b.samples, seq_lens=b.seq_lens,
                  layer_ids=b.layer_ids)
    tensors = {"input_ids": b.input_ids, "loss_mask": b.loss_mask, "hidden": b.hidden.to(torch.bfloat16),
               "final_hidden": b.final_hidden.to(torch.bfloat16)}
    msg = codec.decode_batch([bytes(f) for f in codec.encode(header("batch", "20261129T000000Z-abcd", **fields),
                                                               tensors)])
    got = msg.owned(torch.float32)
    assert torch.equal(got.final_hidden, b.final_hidden.to(torch.bfloat16).float())
    bad = dict(tensors, final_hidden=b.final_hidden[:, :5].contiguous())
    with pytest.raises(ProtocolError, match="final_hidden must be"):
        codec.decode([bytes(f) for f in codec.encode(header("batch", "20261129T000000Z-abcd", **fields), bad)])
