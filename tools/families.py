"""Random-weight causal LMs of the families the producer supports, built from configs in
memory (no tokenizer, no files): tiny ones for the decoding core's exactness tests, and
real-sized shapes (`SHAPES`) for bench/decode_speed.py, where shape alone decides speed.

Tiny models use small sliding windows so that short prompts already cross them, and a
larger init scale than transformers' default so that greedy outputs vary (near-flat
logits would make every test prompt decode the same few tokens).
"""

from __future__ import annotations

FAMILIES = ("llama", "qwen3", "qwen2_sliding", "mistral", "gemma2", "gemma3", "phi3")
WINDOW = 8  # tiny models' sliding window


def tiny_config(family: str, *, vocab: int = 512, layers: int = 4, window: int = WINDOW, tie: bool = False):
    """The config of a tiny `family` model (sliding-window families with `window`)."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=tie, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16)
    if family == "qwen2_sliding":  # sliding from layer 2 on (max_window_layers), full below
        return tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=window, max_window_layers=2)
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=window, head_dim=16)
    if family == "gemma2":  # alternating sliding/full, soft-capped attention and logits
        return tf.Gemma2Config(**common, head_dim=16, sliding_window=window, query_pre_attn_scalar=16)
    if family == "gemma3":
        return tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=window, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    if family == "phi3":
        return tf.Phi3Config(**common, sliding_window=window)
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


def build(config, *, seed: int = 0, dtype=None, device=None):
    """A randomly initialised causal LM of `config` (eval mode, no grad)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    attn = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32, attn_implementation=attn)
    if device is not None:
        model = model.to(device)
    return model.eval().requires_grad_(False)


def tiny_model(family: str, *, seed: int = 0, **kw):
    return build(tiny_config(family, **kw), seed=seed)


# Real models' shapes (random weights): name -> (family, config fields).
SHAPES = {
    # SmolLM2-135M(-Instruct): Llama, tied embeddings.
    "smollm2-135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                   tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
                                   max_position_embeddings=8192)),
    "qwen3-0.6b": ("qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                 max_position_embeddings=40960)),
    "qwen3-8b": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6,
                               max_position_embeddings=40960)),
}


def shape_config(name: str):
    import transformers as tf

    family, fields = SHAPES[name]
    cls = {"llama": tf.LlamaConfig, "qwen3": tf.Qwen3Config}[family]
    return cls(**fields, pad_token_id=0, bos_token_id=1, eos_token_id=2)
