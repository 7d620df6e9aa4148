"""The few transformers calls whose spelling differs across the versions we support
(the lower bound in pyproject.toml to today's 5.x), in one place for producers and consumers alike."""

from __future__ import annotations

import inspect

from torch import nn


def new_cache(model: nn.Module):
    """An empty KV cache for `model` (DynamicCache: grows one token at a time)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cache_kwarg(model: nn.Module) -> str:
    """The forward() argument that takes the KV cache (`cache` since transformers 5.2x, else `past_key_values`)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def renamed_key(key: str, renamings, converters, prefix: str | None, meta: dict) -> str:
    """The parameter name transformers 5 loads checkpoint key `key` into; `key` itself without a renaming."""
    try:
        from transformers.core_model_loading import rename_source_key
    except ImportError:
        return key
    try:
        return rename_source_key(key, list(renamings), list(converters), prefix, meta)[0]
    except Exception:  # noqa: BLE001  (a renaming that cannot read this key: it is not renamed)
        return key


def causal_lm_class(config) -> type | None:
    """The transformers class AutoModelForCausalLM builds for `config` (None: not built in)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None


def sharded_config(text_config, world_size: int):
    """The DistributedConfig that shards a target over `world_size` ranks, experts included: since
    transformers 5.2x only the expert-parallel plan shards experts, and only when `ep_size` asks."""
    from transformers.distributed.configuration_utils import DistributedConfig

    fields = getattr(DistributedConfig, "__dataclass_fields__", {})
    experts_by_ep = getattr(text_config, "base_model_ep_plan", None) and "ep_size" in fields
    tp_plan = getattr(text_config, "base_model_tp_plan", None) or {}
    if experts_by_ep and not any(".experts" in k for k in tp_plan) and world_size > 1:
        return DistributedConfig(tp_plan="auto", ep_size=world_size)
    return DistributedConfig(tp_plan="auto")
