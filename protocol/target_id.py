"""A target's identity (runtime/target_heads.py), compared without torch so the broker can check it."""

from __future__ import annotations

IDENTITY_KEYS = ("model_type", "config_sha256", "heads_sha256")


def same_target(a, b) -> bool:
    """Whether two target identities name the same target."""
    return isinstance(a, dict) and isinstance(b, dict) and all(a.get(k) == b.get(k) for k in IDENTITY_KEYS)


def describe_target(identity) -> str:
    """For an error message: 'qwen3 (config 1a2b3c4d5e6f, heads 3c4d5e6f7a8b)'."""
    if not isinstance(identity, dict):
        return "unknown (not stated)" if identity is None else repr(identity)[:80]
    return (f"{str(identity.get('model_type'))[:32]} (config {str(identity.get('config_sha256'))[:12]}, "
            f"heads {str(identity.get('heads_sha256'))[:12]})")
