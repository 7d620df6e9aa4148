"""The attention the decoding core runs (decoding/core.py): flex over each row's own blocks in a
GPU decode step, sdpa with additive masks elsewhere (docs/REGENERATION.md "Decode attention").
Imports no role, so a GPU benchmark can load it on a bare machine."""

from __future__ import annotations

import warnings

import torch
from torch import nn

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch < 2.5: the sdpa path only
    BlockMask = flex_attention = None

FULL, SLIDING = "full_attention", "sliding_attention"


def text_config(model: nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def layer_windows(model: nn.Module) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention), as transformers applies it."""
    cfg = text_config(model)
    n, window = cfg.num_hidden_layers, getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:  # Mistral, Phi-3: one window (or none) for every layer
        return [window] * n
    bad = sorted(set(types) - {FULL, SLIDING})
    if bad:
        raise ValueError(f"{cfg.model_type}: layer types {bad} are not supported by the decoding core "
                         f"(full and sliding-window attention are)")
    if SLIDING in types and not window:
        raise ValueError(f"{cfg.model_type}: sliding-window layers but no config.sliding_window")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(f"{cfg.model_type}: bidirectional attention is not causal decoding")
    return [window if t == SLIDING else None for t in types[:n]]


DECODE = "decoding_core"  # no "flash" in it: transformers takes such names for hub kernels


def _decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """flex when the core passes a BlockMask (GPU decode steps), else sdpa with its additive mask."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError(f"{DECODE}: soft-capping and attention sinks are not supported (decoding uses eager)")
    if BlockMask is not None and isinstance(attention_mask, BlockMask):
        return _flex(query, key, value, attention_mask, scaling), None
    return _sdpa_packed(query, key, value, attention_mask, scaling), None


def _sdpa_packed(query, key, value, attention_mask, scaling):
    """sdpa without repeat_kv (transformers copies the whole cache per layer and step when
    given a mask): query heads sharing a K/V head become extra query rows instead."""
    B, Hq, q, hd = query.shape
    Hkv = key.shape[1]
    g = Hq // Hkv
    if attention_mask is None:  # a plain forward of the model (not the core's): causal
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=q > 1, scale=scaling,
                                                               enable_gqa=g > 1)
        return out.transpose(1, 2).contiguous()
    qp = query.reshape(B, Hkv, g * q, hd)
    mask = attention_mask[:, :, :, : key.shape[2]]
    if g > 1:
        mask = mask[:, :, None].expand(B, mask.shape[1], g, q, mask.shape[-1]).reshape(B, mask.shape[1], g * q, -1)
    out = torch.nn.functional.scaled_dot_product_attention(qp, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(B, Hq, q, hd).transpose(1, 2).contiguous()


FLEX_COMPILE: bool | None = None  # None: compiled on CUDA, eager elsewhere (tests set True to run the CPU kernel)
_flex_compiled = None


def _flex(query, key, value, block_mask, scaling):
    """flex attention, compiled on a GPU (uncompiled flex computes every score in full)."""
    global _flex_compiled
    fn = flex_attention
    if FLEX_COMPILE or (FLEX_COMPILE is None and query.is_cuda):
        if _flex_compiled is None:
            import torch._dynamo

            # One graph per cache shape and window kind; past the limit dynamo falls back to slow uncompiled flex.
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
            _flex_compiled = torch.compile(flex_attention, dynamic=False)
        fn = _flex_compiled
    B, Hq, q, hd = query.shape
    g = Hq // key.shape[1]
    if fold_heads(Hq, key.shape[1]):  # the query heads of a K/V head as more queries of it (Core._block_masks)
        out = fn(query.reshape(B, key.shape[1], g * q, hd), key, value, block_mask=block_mask, scale=scaling)
        return out.reshape(B, Hq, q, hd).transpose(1, 2).contiguous()
    out = fn(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=g > 1)
    return out.transpose(1, 2).contiguous()


def fold_heads(heads: int, kv_heads: int) -> bool:
    """Fold query heads into the query length: flex decoding serves GQA only for a power-of-two
    group (else inductor's prefill kernel pads each row's one query to a tile)."""
    g = heads // kv_heads
    return g > 1 and g & (g - 1) != 0


def _register() -> bool:
    try:
        from transformers import AttentionInterface

        AttentionInterface.register(DECODE, _decode_attention)
        return True
    except (ImportError, AttributeError):  # older transformers: plain sdpa
        return False


_HAS_DECODE = _register()


def decode_attention(model: nn.Module) -> str:
    """The core's own attention, or eager where the model needs soft-capping (Gemma 2) or
    sinks (GPT-OSS refuses sdpa)."""
    cfg = text_config(model)
    if getattr(cfg, "attn_logit_softcapping", None) or not getattr(type(model), "_supports_sdpa", True):
        return "eager"
    return DECODE if _HAS_DECODE else "sdpa"


def step_kernel(model: nn.Module, device: torch.device, kernel: str = "auto") -> str:
    """"flex" (block-sparse over each row's slots) or "sdpa" (all slots, masked); auto: flex on a GPU."""
    if kernel not in ("auto", "flex", "sdpa"):
        raise ValueError(f"decode kernel {kernel!r}: expected auto, flex or sdpa")
    if kernel == "auto":
        kernel = "flex" if device.type == "cuda" else "sdpa"
    if kernel == "flex" and (BlockMask is None or decode_attention(model) != DECODE):
        return "sdpa"  # eager-attention models and old torch: masks only
    return kernel



def block_mask(count, index, block_size, mask_mod, seq_lengths):
    try:  # no transposed (backward) block lists: decoding never runs a backward
        return BlockMask.from_kv_blocks(count, index, BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                        seq_lengths=seq_lengths, compute_q_blocks=False)
    except TypeError:  # a torch without the flag
        return BlockMask.from_kv_blocks(count, index, BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                        seq_lengths=seq_lengths)


def visible(qslot: torch.Tensor, off: torch.Tensor, window: int | None, q: int):
    """flex's mask_mod for `Core._block_masks` (query i is query i % q: folded heads repeat them)."""

    def mask_mod(b, h, q_idx, kv_idx):
        t = qslot[b, q_idx % q]
        vis = (kv_idx >= off[b]) & (kv_idx <= t)
        return vis if window is None else vis & (t - kv_idx < window)

    return mask_mod


class attending:
    """Run the model with attention implementation `name` for the duration (restored after)."""

    def __init__(self, model: nn.Module, name: str):
        self.model, self.name = model, name

    def __enter__(self):
        cfg = self.model.config
        self.before = getattr(cfg, "_attn_implementation", None)
        if self.before != self.name:
            try:
                self.model.set_attn_implementation(self.name)
            except (ValueError, KeyError) as e:  # a transformers that refuses registered names
                if self.name != DECODE:
                    raise
                warnings.warn(f"attention {DECODE} refused ({e}); decoding with sdpa")
                self.name = "sdpa"
                if self.before != self.name:
                    self.model.set_attn_implementation(self.name)

    def __exit__(self, *exc):
        if self.before != self.name and self.before is not None:
            self.model.set_attn_implementation(self.before)
