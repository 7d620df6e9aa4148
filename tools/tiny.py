"""Tiny randomly initialised Hugging Face targets for tests, the demo and benchmarks.

`tiny_target()` builds a small causal LM from a config (Qwen3 by default, or Llama) and a
byte-level BPE tokenizer trained on the bundled sample chats, with a real Jinja chat
template, and saves both with `save_pretrained`. Loading goes through exactly the code path
of a real checkpoint (`AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained`),
which is the point: the producer never learns it is talking to a toy.

No network. Built once per spec and cached (`$DFLASH_TINY_CACHE`, default
`~/.cache/dflash/tiny`); the build goes to a temporary folder renamed into place, so
concurrent test processes never see half a model.

    python -m dflash.tools.tiny --family llama --tie     # prints the folder
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import click

MASK_TOKEN = "<|mask|>"  # an unused vocabulary row reserved for DFlash's block MASK

# Chat templates shaped like the real families' (ChatML for Qwen, header/eot for Llama 3),
# so loss-mask code is exercised against the same kind of markup as in production.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

GEMMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' + "
    "message['content'] + '<end_of_turn>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
)

# family -> (special tokens, bos, eos, pad, chat template); Gemma's tokenizer has its own
# <mask> and <unusedN> tokens, as the real one does
_FAMILIES = {
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", MASK_TOKEN],
              None, "<|im_end|>", "<|endoftext|>", CHATML_TEMPLATE),
    "llama": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
               "<|eot_id|>", MASK_TOKEN],
              "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>", LLAMA3_TEMPLATE),
    "gemma": (["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<unused0>",
               "<unused1>", MASK_TOKEN],
              "<bos>", "<eos>", "<pad>", GEMMA_TEMPLATE),
}
# Without DFlash's <|mask|> (TinySpec.mask_token False), a family's tokenizer is what the
# real one is: Llama 3 reserves special tokens; Qwen3 has only its own.
_RESERVED = {"llama": ["<|reserved_special_token_0|>", "<|reserved_special_token_1|>"]}
_BUILD_VERSION = 2  # bump when the build changes, so stale caches are not reused


@dataclass(frozen=True)
class TinySpec:
    family: str = "qwen3"
    tie: bool = False
    layers: int = 6
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 1024  # BPE vocabulary the tokenizer is trained to
    model_vocab: int = 0  # embedding rows; 0 = the tokenizer's size (real models pad it)
    seed: int = 0
    mask_token: bool = True  # the tokenizer reserves DFlash's <|mask|> (off: the family's own tokens only)

    def key(self) -> str:
        fields = asdict(self)
        if self.mask_token:  # the default: the key of targets built before the field existed
            del fields["mask_token"]
        blob = json.dumps({**fields, "build": _BUILD_VERSION}, sort_keys=True)
        return f"{self.family}-L{self.layers}-H{self.hidden}-{'tied' if self.tie else 'untied'}-" \
               f"{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_TINY_CACHE") or Path.home() / ".cache" / "dflash" / "tiny")


def _corpus() -> list[str]:
    """Training text for the tokenizer: the bundled chats, so the demo data tokenises well."""
    from dflash.producers.sample_data import generate_chats

    roles = ["system", "user", "assistant"] * 50  # role names appear in every template render
    return roles + [m["content"] for chat in generate_chats() for m in chat["messages"]]


def build_tokenizer(family: str = "qwen3", vocab: int = 1024, mask_token: bool = True):
    """A byte-level BPE `PreTrainedTokenizerFast` with the family's chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, bos, eos, pad, template = _FAMILIES[family]
    if not mask_token:
        specials = [t for t in specials if t != MASK_TOKEN] + _RESERVED.get(family, [])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte encodes: no UNK
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
        additional_special_tokens=[MASK_TOKEN] if mask_token else _RESERVED.get(family, []),
    )
    fast.chat_template = template
    return fast


def build_model(spec: TinySpec, tokenizer):
    """A randomly initialised causal LM whose vocabulary covers `tokenizer`."""
    import torch
    from transformers import AutoModelForCausalLM, GemmaConfig, LlamaConfig, Qwen3Config

    vocab = max(spec.model_vocab, len(tokenizer))
    common = dict(
        vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, head_dim=spec.hidden // spec.heads,
        max_position_embeddings=4096, tie_word_embeddings=spec.tie,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = {"qwen3": Qwen3Config, "llama": LlamaConfig, "gemma": GemmaConfig}[spec.family](**common)
    torch.manual_seed(spec.seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def tiny_target(cache_dir: str | os.PathLike | None = None, **spec_fields) -> Path:
    """The folder of a tiny target (model + tokenizer), built on first use.

    Raises ValueError for an unknown family."""
    spec = TinySpec(**spec_fields)
    if spec.family not in _FAMILIES:
        raise ValueError(f"unknown family {spec.family!r}; choose from {sorted(_FAMILIES)}")
    root = Path(cache_dir) if cache_dir else cache_root()
    out = root / spec.key()
    if (out / "config.json").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.key()}-", dir=root))
    try:
        tokenizer = build_tokenizer(spec.family, spec.vocab, spec.mask_token)
        model = build_model(spec, tokenizer)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "tiny_spec.json").write_text(json.dumps(asdict(spec), indent=2))
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first: theirs is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@click.command()
@click.option("--family", type=click.Choice(sorted(_FAMILIES)), default="qwen3", show_default=True,
              help="Model family of the tiny target.")
@click.option("--tie/--no-tie", default=False, show_default=True, help="Tie input embeddings and LM head.")
@click.option("--layers", default=6, show_default=True, help="Decoder layers.")
@click.option("--hidden", default=64, show_default=True, help="Hidden size.")
@click.option("--vocab", default=1024, show_default=True, help="Tokenizer vocabulary size.")
@click.option("--seed", default=0, show_default=True, help="Weight initialisation seed.")
@click.option("--cache-dir", default=None, help="Where tiny targets are cached (default ~/.cache/dflash/tiny).")
def main(family: str, tie: bool, layers: int, hidden: int, vocab: int, seed: int, cache_dir: str | None) -> None:
    """Build (or find) a tiny target and print its folder."""
    click.echo(tiny_target(cache_dir, family=family, tie=tie, layers=layers, hidden=hidden,
                           vocab=vocab, seed=seed))


if __name__ == "__main__":
    main()
