"""--regenerate ahead of the leases (producers/regen_ahead.py): one regeneration thread
decodes continuously, a lease's batches go as its rows become ready, every sample once;
the IDs equal regenerating each row alone (greedy, exact); a producer killed mid-way
resumes from the cache (only the missing rows are made again, the dead one's claims
are taken over). Tiny real targets on CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from structlog.testing import capture_logs

from tests.harness.tiny import tiny_dir
from tests.producers.helpers import chat, write_jsonl

from dflash.producers.chat import ChatEncoder
from dflash.producers.data import Row, open_dataset
from dflash.producers.producer import LocalWorkSource, Producer
from dflash.producers.regen_ahead import Claims, RegenAhead
from dflash.producers.regenerate import RegenCache, Regenerator
from dflash.producers.target import load_target
from dflash.protocol.batch import Batch

pytestmark = pytest.mark.integration

CPU = torch.device("cpu")
NEW = 12


def _rows(n: int) -> list[dict]:
    # one, two and three turns, and a prompt alone: answers of different lengths
    out = []
    for i in range(n):
        c = chat(i, turns=1 + i % 3)
        if i % 4 == 3:
            c["messages"] = c["messages"][:1]
        out.append(c)
    return out


def _regenerator(target, tokenizer, folder, key="k", batch_size=4) -> Regenerator:
    return Regenerator(target, tokenizer, RegenCache(folder, key), max_new_tokens=NEW, batch_size=batch_size)


def _one_by_one(target, tokenizer, data, folder) -> dict[int, tuple[list[int], list[int]]]:
    """Each row regenerated alone (a decoder of one row): the reference."""
    regen = _regenerator(target, tokenizer, folder, batch_size=1)
    out = {}
    for s in range(len(data)):
        (r,) = regen.apply([data.read(s)])
        out[s] = (r.input_ids, r.loss_mask)
    return out


def test_batches_stream_as_rows_are_ready_every_sample_once_and_exact(tiny, tokenizer, tmp_path, monkeypatch):
    import dflash.producers.regen_ahead as ahead

    monkeypatch.setattr(ahead, "PROGRESS_S", 0.0)  # a progress line after every slice
    target = load_target(str(tiny), None, device=CPU, full=True)
    path = write_jsonl(tmp_path / "d.jsonl", _rows(12) + [{"text": "plain text row"}])
    data = open_dataset(path)
    sent: list[Batch] = []
    source = LocalWorkSource(len(data), lease_size=5, epochs=2)
    regen = _regenerator(target, tokenizer, tmp_path / "cache")
    prod = Producer(target, data, ChatEncoder(tokenizer, 4096), source, sent.append,
                    token_budget=200, max_batch_size=3, regenerator=regen, regen_ahead=64)
    with capture_logs() as logs:
        summary = prod.run()
    # the decoder's paged KV figures: rows decoding at once, pages used of its pool
    said = [e for e in logs if e["event"] == "produce.regen_progress"]
    assert said and all(0 <= e["pages_used"] <= e["pages_peak"] <= e["pages_total"]
                        and e["live_rows"] <= e["decoder_rows"] for e in said)
    # pages in use now depends on when a line falls (finished rows give theirs back); the peak does not
    assert max(e["live_rows"] for e in said) > 1 and said[-1]["pages_peak"] > 0

    by_epoch: dict[int, list[int]] = {0: [], 1: []}
    got: dict[int, tuple[list[int], list[int]]] = {}
    for b in sent:
        by_epoch[b.epoch] += b.samples
        lease = source.done  # every lease reported done, with nothing skipped
        ids, mask, k = b.tensors["input_ids"].tolist(), b.tensors["loss_mask"].tolist(), 0
        for s, n in zip(b.samples, b.seq_lens):
            got.setdefault(s, (ids[k:k + n], mask[k:k + n]))
            assert got[s] == (ids[k:k + n], mask[k:k + n])  # epoch 2 reads the same IDs back
            k += n
    assert all(sorted(v) == list(range(len(data))) for v in by_epoch.values())  # each sample once per epoch
    assert sorted(lease) == list(range(6)) and all(v == [] for v in lease.values())
    assert summary["samples"] == 2 * len(data) and prod.ahead.rows_done == 12  # generated once, epoch 2 cached

    ref = _one_by_one(target, tokenizer, data, tmp_path / "ref")
    for s in range(12):
        assert got[s] == ref[s], s
    assert sum(got[12][1]) == len(got[12][1])  # the text row: every token has loss, untouched


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_claims_of_a_live_producer_are_respected_and_a_dead_ones_taken_over(tmp_path):
    cache = RegenCache(tmp_path, "k")
    host = Claims(cache).host
    live = Claims(cache, owner=f"{host}:{os.getppid()}")
    dead = Claims(cache, owner=f"{host}:{_dead_pid()}")
    assert live.claim([1, 2]) == ([1, 2], {})
    assert dead.claim([3]) == ([3], {})
    me = Claims(cache)
    assert me.claim([1, 2, 3, 4]) == ([3, 4], {1: live.owner, 2: live.owner})
    live.release([1])
    assert me.claim([1]) == ([1], {})


def test_a_producer_killed_mid_regeneration_resumes_from_the_cache(tmp_path):
    """A real process regenerates ahead and is killed (SIGKILL) once part of the rows are
    cached; a new engine makes only the rest (taking over the dead one's claims), and every
    row equals regenerating it alone."""
    from transformers import AutoTokenizer

    tiny = tiny_dir("qwen3", False)  # one family: the subject is the cache, not the model
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    n = 10
    path = write_jsonl(tmp_path / "d.jsonl", _rows(n))
    folder = tmp_path / "cache"
    script = f"""
import torch, time
torch.set_num_threads(1)
from transformers import AutoTokenizer
from dflash.producers.data import open_dataset
from dflash.producers.regen_ahead import RegenAhead
from dflash.producers.regenerate import RegenCache, Regenerator
from dflash.producers.target import load_target
t = load_target({str(tiny)!r}, None, device=torch.device("cpu"), full=True)
tok = AutoTokenizer.from_pretrained({str(tiny)!r})
r = Regenerator(t, tok, RegenCache({str(folder)!r}, "k"), max_new_tokens={NEW}, batch_size=2)
e = RegenAhead(r, open_dataset({path!r}), ahead={n}, order=list(range({n})), slice_s=0.05)
e.start()
time.sleep(600)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        cache = RegenCache(folder, "k")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(cache) < 3 and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None and len(cache) >= 3
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    done_before = len(cache)
    assert done_before < n, "the run ended before it was killed: make it longer"
    held = cache._db.execute("SELECT COUNT(*) FROM regen_claims").fetchone()[0]
    assert held >= 1  # it died holding claims of rows it was decoding

    data = open_dataset(path)
    target = load_target(str(tiny), None, device=CPU, full=True)
    engine = RegenAhead(_regenerator(target, tokenizer, folder), data, ahead=0, order=list(range(n)))
    engine.start()
    try:
        rows = [data.read(s) for s in range(n)]
        have = engine.request(rows)
        assert len(have) == done_before
        waiting, got = set(range(n)) - set(have), dict(have)
        deadline = time.monotonic() + 120
        while waiting and time.monotonic() < deadline:
            ready = engine.wait(waiting)
            got.update(ready)
            waiting -= set(ready)
        assert not waiting
    finally:
        engine.stop()
    assert engine.rows_done == n - done_before  # nothing regenerated twice
    ref = _one_by_one(target, tokenizer, data, tmp_path / "ref")
    assert {s: (r.input_ids, r.loss_mask) for s, r in got.items()} == ref
    assert cache._db.execute("SELECT COUNT(*) FROM regen_claims").fetchone()[0] == 0
    assert isinstance(rows[0], Row)


@pytest.mark.unit
def test_the_look_ahead_counts_rows_to_make_not_rows_the_cache_holds(tiny, tokenizer, tmp_path):
    # Half of the data regenerated beforehand: `ahead` rows of work still lie ahead, so the
    # decoder's batch stays full instead of trickling through the cached rows.
    n, ahead = 24, 4
    path = write_jsonl(tmp_path / "d.jsonl", _rows(n))
    data = open_dataset(path)
    target = load_target(str(tiny), None, device=CPU, full=True)
    regen = _regenerator(target, tokenizer, tmp_path / "cache")
    regen.apply([data.read(s) for s in range(0, n, 2)])  # the even rows are cached
    engine = RegenAhead(regen, data, ahead=ahead, order=list(range(n)))
    made_first = [r.sample for r in engine._next_ahead(room=100)]
    assert made_first == [1, 3, 5, 7]  # 4 rows to make, past 4 cached ones
