"""The producer loop end to end on a tiny real target: leases in, wire-valid batches out,
every sample exactly once per epoch, skips reported with reasons, bounded prefetch."""

from __future__ import annotations

import queue
import re
import threading
import time

import pytest
import torch
from tests.producers.helpers import chat, write_jsonl
from structlog.testing import capture_logs

from dflash.producers.chat import ChatEncoder
from dflash.producers.data import BadRow, open_dataset
from dflash.producers.producer import LocalWorkSource, Producer
from dflash.protocol import codec
from dflash.protocol.batch import Batch

RUN = "20261129T154812Z-7f3a"

pytestmark = pytest.mark.unit


def make(target, tokenizer, path, source, sink, **kw) -> Producer:
    kw.setdefault("token_budget", 256)
    kw.setdefault("max_batch_size", 8)
    max_length = kw.pop("max_length", 256)
    return Producer(target, open_dataset(path), ChatEncoder(tokenizer, max_length), source, sink, **kw)


def wire(batch: Batch) -> Batch:
    """Through the real codec, as a consumer's link reads it."""
    return codec.decode_batch(codec.encode_batch(batch, RUN), run=RUN)


def test_every_sample_once_per_epoch_in_valid_batches(target, tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(i, turns=1 + i % 3) for i in range(23)])
    out = []
    source = LocalWorkSource(23, lease_size=10, epochs=2)
    summary = make(target, tokenizer, path, source, lambda b: out.append(wire(b))).run()

    for epoch in (0, 1):
        got = sorted(s for m in out if m.epoch == epoch for s in m.samples)
        assert got == list(range(23)), epoch
    assert summary["samples"] == 46 and summary["skipped"] == 0 and summary["leases"] == 6
    assert source.done == {k: [] for k in range(6)}
    encoder = ChatEncoder(tokenizer, 256)
    ds = open_dataset(path)
    for m in out[:4]:
        t = m.tensors
        assert m.layer_ids == target.layer_ids and m.lease // 3 == m.epoch and m.producer == "local"
        assert t["hidden"].shape == (sum(m.seq_lens), len(target.layer_ids) * target.hidden_size)
        assert t["hidden"].dtype == target.dtype and t["hidden"].is_contiguous()
        off = 0
        for sample, n in zip(m.samples, m.seq_lens):
            enc = encoder.encode(ds.read(sample))
            assert t["input_ids"][off:off + n].tolist() == enc.input_ids
            assert t["loss_mask"][off:off + n].tolist() == enc.loss_mask
            alone = target.capture(torch.tensor(enc.input_ids), torch.arange(n))
            torch.testing.assert_close(t["hidden"][off:off + n], alone, rtol=0, atol=1e-5)
            off += n


BAD = ['{"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "no answer"}]}', '{"broken json']


def test_bad_row_stops_the_run_naming_file_and_line(target, tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(i) for i in range(5)], raw_lines=BAD)
    p = make(target, tokenizer, path, LocalWorkSource(7, lease_size=4), lambda b: None)
    with pytest.raises(BadRow, match=rf"^{re.escape(path)}:6: .*no assistant turn"):
        p.run()


def test_skip_bad_rows_counts_logs_and_reports_them(target, tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(i) for i in range(5)], raw_lines=BAD)
    source = LocalWorkSource(7, lease_size=4)
    out = []
    with capture_logs() as logs:
        p = make(target, tokenizer, path, source, lambda b: out.append(b), skip_bad_rows=True)
        summary = p.run()
    assert sorted(s for b in out for s in b.samples) == [0, 1, 2, 3, 4]
    assert [s for s, _ in source.done[1]] == [5, 6]
    assert source.done[1][0][1].startswith(f"bad_row: {path}:6: ")
    assert "invalid JSON" in source.done[1][1][1]
    bad = [e for e in logs if e["event"] == "produce.bad_row"]
    assert [(e["sample"], e["source"], e["bad_rows"]) for e in bad] == [(5, f"{path}:6", 1), (6, f"{path}:7", 2)]
    assert summary["bad_rows"] == 2 and summary["skipped"] == 2 and p.stats()["bad_rows"] == 2


def test_rows_with_no_assistant_token_left_are_reported(target, tokenizer, tmp_path):
    long_question = {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [chat(0), long_question])
    source = LocalWorkSource(2)
    make(target, tokenizer, path, source, lambda b: None, max_length=64).run()
    assert source.done[0] == [(1, "no_loss_tokens: no assistant token within --max-length")]


def test_prefetch_is_bounded_and_reported_while_the_sink_blocks(target, tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(i) for i in range(40)])
    sent: queue.Queue = queue.Queue(maxsize=1)  # a full outbox: backpressure
    p = make(target, tokenizer, path, LocalWorkSource(40, lease_size=5), lambda b: sent.put(b),
             max_batch_size=2, prefetch=3)
    runner = threading.Thread(target=p.run)
    runner.start()
    deadline = time.monotonic() + 20
    while p.stats()["q_pre"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # had the queue no bound, the prefetcher would now run ahead
    stats = p.stats()
    assert stats["q_pre"] == 3 and stats["state"] == "producing"
    got = []
    while runner.is_alive() or not sent.empty():
        try:
            got.append(sent.get(timeout=0.1))
        except queue.Empty:
            pass
    runner.join()
    assert sorted(s for b in got for s in b.samples) == list(range(40))
    assert p.stats()["q_pre"] == 0 and p.stats()["state"] == "done"


def test_fp8_encoding_halves_the_hidden_bytes(target, tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(i) for i in range(4)])
    raw, fp8 = [], []
    make(target, tokenizer, path, LocalWorkSource(4), lambda b: raw.append(wire(b))).run()
    make(target, tokenizer, path, LocalWorkSource(4), lambda b: fp8.append(wire(b)),
         hidden_encoding="fp8_e4m3_rowscale").run()
    a, b = raw[0], fp8[0]
    assert b.hidden_encoding == "fp8_e4m3_rowscale" and b.tensors["hidden"].dtype == torch.float8_e4m3fn
    assert b.tensors["hidden"].nbytes * 4 == a.tensors["hidden"].nbytes  # float32 tiny model: 1/4
    h_raw, h_fp8 = (m.hidden_as(torch.float32) for m in (a, b))
    assert ((h_fp8 - h_raw).norm(dim=1) / h_raw.norm(dim=1)).max() < 0.05
