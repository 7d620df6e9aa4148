"""Tiny random targets of the families whose config keys and tensor names are not
Llama's, saved with save_pretrained as real checkpoints are (no tokenizer: a consumer
reads only the config and the two vocabulary tensors)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB, HIDDEN, LAYERS, HEADS = 256, 32, 4, 4


def family_config(family: str, tie: bool | None = None):
    """A tiny transformers config of `family`, in the family's own spelling of each field."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "gpt2":  # n_embd, n_head, n_layer, n_positions
        cfg = tf.GPT2Config(n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, n_positions=256, **common)
    elif family == "gpt_neox":  # embed_in / embed_out
        cfg = tf.GPTNeoXConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
                               intermediate_size=64, max_position_embeddings=256, **common)
    elif family == "falcon":  # word_embeddings, ffn_hidden_size, layer_norm_epsilon
        cfg = tf.FalconConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS, **common)
    elif family == "gemma2":
        cfg = tf.Gemma2Config(hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=HEADS,
                              num_key_value_heads=2, head_dim=8, num_hidden_layers=LAYERS, sliding_window=16,
                              max_position_embeddings=256, **common)
    elif family == "gemma3_text":
        cfg = tf.Gemma3TextConfig(hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=HEADS,
                                  num_key_value_heads=2, head_dim=8, num_hidden_layers=LAYERS, sliding_window=16,
                                  max_position_embeddings=256, **common)
    elif family == "gpt_oss":  # no sdpa in transformers; attention sinks; a 128-token window in the real one
        cfg = tf.GptOssConfig(hidden_size=HIDDEN, intermediate_size=HIDDEN, num_attention_heads=HEADS,
                              num_key_value_heads=2, head_dim=8, num_hidden_layers=LAYERS, num_local_experts=4,
                              num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
                              layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2), **common)
    else:
        raise ValueError(f"no tiny config for family {family!r}")
    if tie is not None:
        cfg.tie_word_embeddings = tie
    return cfg


def family_target(path: Path, family: str, tie: bool | None = None, seed: int = 0) -> Path:
    """Save a tiny random `family` causal LM at `path` (built once per path)."""
    from transformers import AutoModelForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, tie), dtype=torch.float32)
    model.save_pretrained(path)
    return path
