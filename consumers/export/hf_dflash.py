"""The DFlash drafter as a transformers model: `dflash-export` copies this file, as is, to
`dflash.py` beside the weights, which `config.json`'s `auto_map` names, so

    AutoModel.from_pretrained(export_dir, trust_remote_code=True)

works with torch and transformers alone (4.57 and 5.x). It therefore imports nothing of
this project. It computes what consumers/drafter/model.py computes (tests hold the two equal), in
the module names of the published drafters and with the forward signature of the DFlash
authors' reference `DFlashDraftModel`:

    forward(position_ids, attention_mask=None, noise_embedding=None, target_hidden=None,
            past_key_values=None, use_cache=False) -> [batch, block, hidden]

noise_embedding [b, q, D]: the target's embedding of the block [bonus, MASK x (q-1)];
target_hidden [b, c, n*D]: target features (layers dflash_config.target_layer_ids, layer i
= hidden_states[i + 1]) of the c context tokens not yet in `past_key_values`;
position_ids [b, c + q]: their positions, then the block's. Every block position attends
to all cached and new context and to the whole block (no causal mask); `attention_mask`,
if given, is passed to scaled_dot_product_attention as is (bool: True = attend, or
additive), shaped to broadcast over [b, heads, q, cached + c + q]. With a cache, the
context's and the block's keys/values are appended to it: drop the block's again before
the next block (`past_key_values.crop(-q)`), as the reference does. The
output is final-normed: apply the target's LM head to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config


def _rope_theta(config) -> float:
    # transformers 5 keeps it in rope_parameters; 4.x configs at the top level.
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ValueError(f"RoPE type {kind!r}: this drafter uses plain RoPE only")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("config has no rope_theta")
    return float(theta)


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # fp32 statistics whatever the weights' dtype
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, n, hd]; cos/sin [b, n, hd]; rotate-half convention (Qwen3, Llama)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DFlashAttention(nn.Module):
    """Queries from the block only; keys/values from [context | block] through the same
    projections (the target features are injected into every layer's K/V)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        D = config.hidden_size
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or D // self.n_heads
        hd = self.head_dim
        self.q_proj = nn.Linear(D, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(D, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(D, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, D, bias=False)
        self.q_norm = DFlashRMSNorm(hd, config.rms_norm_eps)  # per head, before RoPE
        self.k_norm = DFlashRMSNorm(hd, config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, attention_mask=None, past_key_values=None):
        b, q_len, _ = x.shape
        n, hd = ctx.shape[1] + q_len, self.head_dim
        kv_in = torch.cat([ctx.to(x.dtype), x], dim=1)  # [b, c + q, D]
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.n_heads, hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, n, self.n_kv, hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, n, self.n_kv, hd).transpose(1, 2)
        q, k = _rotate(q, cos[:, -q_len:], sin[:, -q_len:]), _rotate(k, cos, sin)
        if past_key_values is not None:  # earlier context in front: [cached | c | q]
            k, v = past_key_values.update(k, v, self.layer_idx)
        groups = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=hd**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.n_heads * hd))


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, attention_mask=None, past_key_values=None):
        # The context is normed once (hidden_norm), not by input_layernorm.
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, attention_mask, past_key_values)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config):
        super().__init__(config)
        dc = getattr(config, "dflash_config", None) or {}
        self.target_layer_ids = list(dc.get("target_layer_ids") or [])
        if not self.target_layer_ids:
            raise ValueError("config.dflash_config.target_layer_ids is missing")
        self.mask_token_id = dc.get("mask_token_id")
        self.block_size = int(getattr(config, "block_size", 16))
        D = config.hidden_size
        self.rope_theta = _rope_theta(config)
        self.head_dim = getattr(config, "head_dim", None) or D // config.num_attention_heads
        self.fc = nn.Linear(len(self.target_layer_ids) * D, D, bias=False)
        self.hidden_norm = DFlashRMSNorm(D, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(D, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module):
        # Only for weights a checkpoint lacks: N(0, initializer_range) linears, unit norms.
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, getattr(self.config, "initializer_range", 0.02))
        elif isinstance(module, DFlashRMSNorm):
            module.weight.data.fill_(1.0)

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [b, n, head_dim] at `position_ids` [b, n]. Computed per call, not kept in a
        buffer: a buffer would be created on the meta device by transformers' loading."""
        hd = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device=position_ids.device) / hd))
        freqs = position_ids.float()[..., None] * inv.float()  # [b, n, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, position_ids, attention_mask=None, noise_embedding=None, target_hidden=None,
                past_key_values=None, use_cache=False, **kwargs):
        if noise_embedding is None or target_hidden is None:
            raise ValueError("DFlashDraftModel needs noise_embedding and target_hidden")
        if position_ids.shape[-1] != target_hidden.shape[1] + noise_embedding.shape[1]:
            raise ValueError(f"position_ids has {position_ids.shape[-1]} positions; expected context "
                             f"{target_hidden.shape[1]} + block {noise_embedding.shape[1]}")
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        x = noise_embedding
        ctx = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        cos, sin = self.rope(position_ids.expand(x.shape[0], -1))
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, attention_mask, past_key_values)
        return self.norm(x)
