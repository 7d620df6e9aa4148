"""Random-weight causal LMs of the families the producer supports, built from configs in
memory (no tokenizer, no files): tiny ones for the decoding core's exactness tests, and
real-sized shapes (`SHAPES`) for bench/decode_speed.py, where shape alone decides speed.

Tiny models use small sliding windows so that short prompts already cross them, and a
larger init scale than transformers' default so that greedy outputs vary (near-flat
logits would make every test prompt decode the same few tokens).
"""

from __future__ import annotations

FAMILIES = ("llama", "qwen3", "qwen2_sliding", "mistral", "gemma2", "gemma3", "phi3", "gpt_oss")
# Every family the pipeline is checked end to end on (tests/test_family_matrix.py): the
# decoding core's families plus MoE, MLA and GPT-2 style ones, with their own config spellings.
MORE_FAMILIES = ("qwen3_moe", "qwen2", "olmo2", "deepseek_v3", "gpt2", "gpt_neox", "falcon")
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
    if family == "qwen2":
        return tf.Qwen2Config(**common)
    if family == "qwen3_moe":  # every layer sparse: 4 experts, 2 per token
        return tf.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    if family == "olmo2":  # norms after attention and MLP, q/k norms
        return tf.Olmo2Config(**common)
    if family == "gpt_oss":  # attention sinks, alternating sliding/full, no sdpa in transformers
        return tf.GptOssConfig(**{**common, "intermediate_size": 64}, head_dim=16, num_local_experts=4,
                               num_experts_per_tok=2, sliding_window=window,
                               rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                                    beta_slow=1.0, truncate=False,
                                                    original_max_position_embeddings=512 // 32),
                               layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    if family == "deepseek_v3":  # multi-head latent attention (K/V heads = query heads); a dense first layer, then MoE
        return tf.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=32,
                                   qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8, n_routed_experts=4,
                                   num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                                   moe_intermediate_size=32, first_k_dense_replace=1)
    gpt = dict(vocab_size=vocab, tie_word_embeddings=tie, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)
    if family == "gpt2":  # n_embd, n_head, n_layer, wte/lm_head
        return tf.GPT2Config(**gpt, n_embd=64, n_head=4, n_layer=layers, n_positions=512)
    if family == "gpt_neox":  # embed_in / embed_out, parallel residual
        return tf.GPTNeoXConfig(**gpt, hidden_size=64, num_attention_heads=4, num_hidden_layers=layers,
                                intermediate_size=128, max_position_embeddings=512)
    if family == "falcon":  # word_embeddings, multi-query attention
        return tf.FalconConfig(**gpt, hidden_size=64, num_attention_heads=4, num_hidden_layers=layers)
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES + MORE_FAMILIES}")


def build(config, *, seed: int = 0, dtype=None, device=None):
    """A randomly initialised causal LM of `config` (eval mode, no grad)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash.runtime.hf_compat import causal_lm_class

    torch.manual_seed(seed)
    cls = causal_lm_class(config)  # sdpa where the class has it (Gemma 2 and GPT-OSS do not)
    supported = getattr(cls, "_supports_sdpa", True)
    attn = "eager" if getattr(config, "attn_logit_softcapping", None) or not supported else "sdpa"
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
