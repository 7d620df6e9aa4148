"""The DFlash drafter (docs/DESIGN.md "The DFlash model").

Qwen3-style layers; the fused target features are injected as extra keys/values through each
layer's own k/v projections. Module names follow the published layout, so `state_dict()`
exports as is. `feature_scale` standardises the features ("massive activations" would
otherwise dominate `fc`); export folds it into `fc.weight`. The layers start random, or as
copies of target layers (`copy_target_layers`, --draft-init)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash.runtime.target_heads import TargetSpec

from . import fused
from .blocks import BlockLayout


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_layers: int  # draft decoder layers (paper: 5)
    num_features: int  # n target layers whose outputs are concatenated (default 5)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    init_std: float = 0.02

    @classmethod
    def from_target(cls, spec: TargetSpec, num_layers: int, num_features: int) -> "DrafterConfig":
        return cls(
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            head_dim=spec.head_dim,
            num_layers=num_layers,
            num_features=num_features,
            rms_norm_eps=spec.rms_norm_eps,
            rope_theta=spec.rope_theta,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.get("rms_norm")(x, self.weight, self.eps)


class Rotary(nn.Module):
    """Plain RoPE (rotate-half convention, as Qwen3 in transformers) at absolute positions."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        # not persistent: the export layout holds trainable weights only
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos.float()[:, None] * self.inv_freq[None, :]  # [N, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [N, hd]
        return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, hd]; cos/sin [N, hd]."""
    return fused.get("rope")(x, cos, sin)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        D, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(D, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(D, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(D, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, D, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)  # per head, before RoPE (Qwen3)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope: tuple, layout: BlockLayout) -> torch.Tensor:
        """x [Q, D] block states, ctx [T, D] fused context -> [Q, D]; keys are [context T | blocks Q]."""
        Q, T, hd = x.shape[0], ctx.shape[0], self.head_dim
        kv_in = torch.cat([ctx.to(x.dtype), x])  # [T+Q, D]
        q = self.q_norm(self.q_proj(x).view(Q, self.n_heads, hd))  # [Q, Hq, hd]
        k = self.k_norm(self.k_proj(kv_in).view(T + Q, self.n_kv, hd))  # [T+Q, Hkv, hd]
        v = self.v_proj(kv_in).view(T + Q, self.n_kv, hd)  # [T+Q, Hkv, hd]
        cos, sin = rope
        q = apply_rope(q, cos[T:], sin[T:])
        k = apply_rope(k, cos, sin)
        q, k = q.to(v.dtype), k.to(v.dtype)  # autocast leaves norms/rope in other dtypes
        out = layout.attend(q, k, v, scale=hd**-0.5)  # [Q, Hq, hd]
        return self.o_proj(out.reshape(Q, self.n_heads * hd))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.get("swiglu")(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope: tuple, layout: BlockLayout) -> torch.Tensor:
        # the context was normed once by hidden_norm, as in the reference: not by input_layernorm
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope, layout)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """The trainable drafter. Embedding and LM head are the target's and live outside."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_features * D, D, bias=False)
        # per input column of fc; ones = the published layout's plain fc
        self.register_buffer("feature_scale", torch.ones(cfg.num_features * D))
        self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=self.cfg.init_std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        self.feature_scale.fill_(1.0)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """features [T, n*D] target hidden states -> [T, D] fused, normed context."""
        w = self.fc.weight * self.feature_scale.to(self.fc.weight.dtype)
        return self.hidden_norm(F.linear(features, w))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if "feature_scale" not in state_dict:
            state_dict = {**state_dict, "feature_scale": torch.ones_like(self.feature_scale)}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, features: torch.Tensor, x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
        """Final-normed block states [Q, D] (for the target's LM head) from context features and block inputs."""
        ctx = self.context(features)  # [T, D]
        if layout.key_pad:  # flex: empty key rows up to a tile boundary, seen by no query
            ctx = F.pad(ctx, (0, 0, 0, layout.key_pad))
        rope = self.rotary(layout.key_positions())  # cos/sin [context_keys + Q, hd]
        for layer in self.layers:
            x = layer(x, ctx, rope, layout)
        return self.norm(x)


DRAFT_INITS = ("random", "first", "last")  # --draft-init (docs/TRAINING.md "Drafter size")
# Llama has none: ours norm q/k anyway, so with ones a copied Llama layer attends unlike the target (a start)
TARGET_OPTIONAL = frozenset({"self_attn.q_norm.weight", "self_attn.k_norm.weight"})


def init_layer_ids(mode: str, draft_layers: int, target_layers: int) -> list[int]:
    """The target layers drafter layers 0..L-1 start as copies of (--draft-init first: 0..L-1; last: the
    target's last L); [] for random. ValueError on an unknown mode or a target of fewer layers."""
    if mode not in DRAFT_INITS:
        raise ValueError(f"--draft-init {mode!r} is none of {', '.join(DRAFT_INITS)}")
    if mode == "random":
        return []
    if target_layers < draft_layers:
        raise ValueError(f"--draft-init {mode} copies one target layer per draft layer: the target has "
                         f"{target_layers} decoder layers, fewer than --draft-layers {draft_layers}")
    start = 0 if mode == "first" else target_layers - draft_layers
    return list(range(start, start + draft_layers))


@torch.no_grad()
def copy_target_layers(model: DFlashDraft, layers: dict[int, dict[str, torch.Tensor]], hidden_act: str | None
                       ) -> list[str]:
    """Drafter layer j <- the j-th of `layers` (target layer -> its tensors by name inside the layer); the
    names of ours left as they were (TARGET_OPTIONAL the target lacks). ValueError where the target's layer
    computes something else: another activation, a tensor ours lacks (biases, extra norms), another shape."""
    if hidden_act not in (None, "silu"):
        raise ValueError(f"--draft-init copies SwiGLU (silu) layers; the target's activation is {hidden_act}")
    if len(layers) != len(model.layers):
        raise ValueError(f"{len(layers)} target layers for {len(model.layers)} draft layers")
    kept: set[str] = set()
    for ours, (i, theirs) in zip(model.layers, layers.items()):
        params = dict(ours.named_parameters())
        extra, missing = sorted(set(theirs) - set(params)), sorted(set(params) - set(theirs) - TARGET_OPTIONAL)
        if extra or missing:
            raise ValueError(f"target layer {i} is not a Qwen3/Llama layer: it has {', '.join(extra) or 'nothing'} "
                             f"beyond a draft layer, and lacks {', '.join(missing) or 'nothing'} of it")
        for name, t in theirs.items():
            if t.shape != params[name].shape:
                raise ValueError(f"target layer {i} {name} has shape {list(t.shape)}, the drafter's "
                                 f"{list(params[name].shape)}")
            params[name].copy_(t)
        kept |= set(params) - set(theirs)
    return sorted(kept)


@torch.no_grad()
def calibrate_features(model: DFlashDraft, sumsq: torch.Tensor, count: float) -> None:
    """`feature_scale` = 1 / RMS per column from all ranks' first batches; a quiet column is raised at
    most 10x: its first-batch RMS says little, and a huge factor would amplify later noise."""
    rms = (sumsq.double() / max(count, 1.0)).sqrt()
    floor = max(float(rms.median()) * 0.1, 1e-6)
    model.feature_scale.copy_((1.0 / rms.clamp_min(floor)).float())


def fold_feature_scale(weights: dict) -> dict:
    """Checkpoint weights -> the published layout: `feature_scale` folded into fc.weight."""
    out = dict(weights)
    scale = out.pop("feature_scale", None)
    if scale is not None:
        out["fc.weight"] = (out["fc.weight"].float() * scale.float()[None, :]).to(out["fc.weight"].dtype)
    return out


def published_config(
    cfg: DrafterConfig, spec: TargetSpec, *, block_size: int, mask_token_id: int, target_layer_ids: list[int]
) -> dict:
    """config.json in the published DFlash layout (docs/EXPORT.md): plain RoPE stated, as trained."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        "num_target_layers": spec.num_hidden_layers,
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": spec.max_position_embeddings,
        "vocab_size": spec.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    }
