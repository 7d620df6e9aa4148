"""Speculative decoding on the decoding core is lossless for every family the producer
supports, sliding windows included (issue: `cache.crop` raised once a sliding layer had
reached its window), with accepted and rejected drafts on both sides of the window."""

import pytest
import torch

from dflash.consumers.export.export import Drafter
from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig
from dflash.consumers.evaluation.speculative import Speculative, TargetGreedy
from dflash.tools.families import FAMILIES, WINDOW, tiny_model

pytestmark = pytest.mark.unit

B, NEW = 4, 30


def _binary_target(family: str):
    """A tiny target whose LM head has two opposite, large rows: greedy output is mostly
    those two tokens (chosen by the sign of one direction of the context's state), so a
    random drafter is right often enough to have drafts accepted, not only rejected."""
    m = tiny_model(family)
    head = m.get_output_embeddings().weight
    u = torch.nn.functional.normalize(torch.randn(head.shape[1], generator=torch.Generator().manual_seed(5)), dim=0)
    head[5], head[6] = 6 * u, -6 * u
    return m


def _drafter(vocab: int) -> Drafter:
    torch.manual_seed(1)
    model = DFlashDraft(DrafterConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, num_layers=2, num_features=2))
    for p in model.parameters():
        if p.dim() > 1:
            p.data.normal_(0, 0.3)
    return Drafter(model.eval(), B, vocab - 1, [0, 2], 4, {})


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_equals_generate_past_the_window(family):
    torch.set_num_threads(1)
    m = _binary_target(family)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 2 * WINDOW + 3)]
    spec = Speculative(m, _drafter(m.config.vocab_size), max_prompt=32, max_new_tokens=NEW, stop_ids=set())
    base = TargetGreedy(m, max_prompt=32, max_new_tokens=NEW, stop_ids=set())
    accepted, rejected = 0, 0
    for p in prompts:
        want = m.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist()
        s = spec(p)  # the same decoder for every prompt: nothing of one prompt leaks into the next
        assert s.tokens == want, f"{family}: prompt of {len(p)} tokens"
        assert base(p).tokens == want
        assert sum(s.accept_lengths) == NEW - 1
        accepted += s.accepted
        rejected += sum(n < B for n in s.accept_lengths)
    assert accepted > 0 and rejected > 0  # both kinds of crop happened
    assert len(prompts[1]) + NEW > 3 * WINDOW


def test_a_stop_token_inside_an_accepted_block_ends_the_output():
    m = _binary_target("mistral")
    d = _drafter(m.config.vocab_size)
    p = torch.randint(3, 500, (2 * WINDOW + 3,), generator=torch.Generator().manual_seed(3)).tolist()
    free = Speculative(m, d, max_prompt=32, max_new_tokens=NEW, stop_ids=set())(p)
    # The first token committed as an accepted draft (not as a bonus) becomes the stop token.
    at, k = 1, None
    for n in free.accept_lengths:
        if n > 1:
            k = at
            break
        at += n
    assert k is not None
    stops = {free.tokens[k]}
    got = Speculative(m, d, max_prompt=32, max_new_tokens=NEW, stop_ids=stops)(p)
    assert got.tokens == free.tokens[: free.tokens.index(free.tokens[k]) + 1]
