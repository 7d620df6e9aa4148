"""The MASK row is chosen for any vocabulary (consumers/drafter/mask_token.py): real tiny targets
of three families start training without --mask-token-id, on batches their own producer
path made, and the row is never a pad/eos/bos/unk token nor in the data."""

import pytest
import torch
from structlog.testing import capture_logs

from dflash.protocol.batch import Batch
from dflash.runtime.target_heads import load_target_heads
from dflash.consumers.training.train import train
from dflash.consumers.training.train_config import resolve_signal
from dflash.consumers.training.config import TrainConfig
from dflash.producers.chat import ChatEncoder
from dflash.producers.data import Row
from dflash.producers.packing import pack
from dflash.producers.sample_data import generate_chats
from dflash.producers.target import load_target
from dflash.runtime.targets import load_tokenizer
from dflash.tools.tiny import tiny_target

pytestmark = pytest.mark.unit

# family, tied, extra embedding rows past the tokenizer, the rule that must pick the row
CASES = [("llama", True, 0, "reserved"), ("qwen3", False, 64, "beyond_tokenizer"), ("gemma", True, 0, "tokenizer_mask")]


def _target(family, tie, extra):
    base = tiny_target(family=family, tie=tie, layers=4, mask_token=False)
    if not extra:
        return base
    return tiny_target(family=family, tie=tie, layers=4, mask_token=False, model_vocab=len(load_tokenizer(base)) + extra)


def _batches(folder, n_rows=6):
    """Packed batches of the bundled chats through the producer's own template and capture."""
    tok = load_tokenizer(folder)
    enc = ChatEncoder(tok, max_length=256)
    rows = [enc.encode(Row(i, "chats", messages=c["messages"])) for i, c in enumerate(generate_chats(n_rows))]
    target = load_target(str(folder), None, device=torch.device("cpu"), dtype="float32")
    out = []
    for p in pack(rows, token_budget=512, max_batch_size=3):
        hidden = target.capture(p.input_ids.long(), p.position_ids())
        out.append(Batch.packed(p.samples, p.seq_lens, p.input_ids, p.loss_mask, hidden.clone(),
                                batch_id=f"b{len(out)}", layer_ids=target.layer_ids))
    return out, tok


@pytest.mark.parametrize("family,tie,extra,rule", CASES)
def test_training_starts_without_mask_token_id_on_a_safe_row(family, tie, extra, rule):
    folder = _target(family, tie, extra)
    batches, tok = _batches(folder)
    heads = load_target_heads(folder, dtype=torch.float32)
    cfg = TrainConfig(draft_layers=1, block_size=4, anchors=8, max_steps=len(batches), log_position_every=0,
                      save_every=0)
    with capture_logs() as logs:
        state = train(cfg, heads, iter(batches))
    assert state.step == len(batches)
    chosen = [e for e in logs if e["event"] == "train.mask_token"]
    assert len(chosen) == 1 and chosen[0]["rule"] == rule, chosen
    mask = chosen[0]["mask_token_id"]
    assert resolve_signal(cfg, heads).mask_token_id == mask
    specials = {tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id} - {None}
    assert mask not in specials
    texts = {tok.convert_ids_to_tokens(s) for s in specials}
    assert mask >= len(tok) or tok.convert_ids_to_tokens(mask) not in texts
    for s in specials:  # not the same embedding row either
        assert not torch.equal(heads.embed[mask], heads.embed[s])
    assert all(not (b.input_ids == mask).any() for b in batches)
    assert not [e for e in logs if e["event"] in ("train.mask_in_data", "train.mask_token_unsafe")]


@pytest.mark.parametrize("which", ["pad", "eos"])
def test_an_explicit_pad_or_eos_mask_is_used_with_a_warning(which):
    folder = _target("llama", True, 0)
    tok = load_tokenizer(folder)
    tid = getattr(tok, f"{which}_token_id")
    heads = load_target_heads(folder, dtype=torch.float32)
    with capture_logs() as logs:
        signal = resolve_signal(TrainConfig(mask_token_id=tid, draft_layers=1), heads)
    assert signal.mask_token_id == tid and signal.mask_choice["rule"] == "explicit"
    warned = [e for e in logs if e["event"] == "train.mask_token_unsafe"]
    assert len(warned) == 1 and any(f"the {which} token" in p for p in warned[0]["problems"]), warned


def test_an_explicit_mask_that_the_data_contains_warns_at_its_first_batch():
    folder = _target("llama", True, 0)
    batches, tok = _batches(folder, n_rows=4)
    common = int(torch.cat([b.input_ids for b in batches]).mode().values)  # the data's commonest token
    heads = load_target_heads(folder, dtype=torch.float32)
    cfg = TrainConfig(draft_layers=1, block_size=4, anchors=8, mask_token_id=common, max_steps=len(batches),
                      log_position_every=0, save_every=0)
    with capture_logs() as logs:
        train(cfg, heads, iter(batches))
    seen = [e for e in logs if e["event"] == "train.mask_in_data"]
    assert len(seen) == 1 and seen[0]["step"] == 1 and seen[0]["tokens"] > 0, seen


def test_a_target_without_tokenizer_or_free_row_is_refused_with_the_option_named(target_dir, heads):
    # tests/consumers' tiny Qwen3 has no tokenizer files and 512 rows: nothing to choose from
    with pytest.raises(ValueError, match="--mask-token-id"):
        resolve_signal(TrainConfig(), heads)
