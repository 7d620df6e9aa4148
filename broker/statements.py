"""What a peer states in its `hello.config` (PROTOCOL.md 4.1), read once into typed fields.

The readers never raise and keep values as sent, so the rules that judge them can quote them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProducerStatement:
    """A producer's target and dataset (each None where it says nothing)."""

    target: object = None
    target_id: object = None
    layer_ids: object = None
    hidden_size: object = None
    vocab_size: object = None
    n_samples: object = None
    fingerprint: object = None
    revoke: bool = False  # it answers `revoke` (PROTOCOL.md 4.3): part of its lease may move to another

    @classmethod
    def read(cls, config: dict) -> ProducerStatement:
        ds = config.get("dataset") if isinstance(config.get("dataset"), dict) else {}
        return cls(config.get("target"), config.get("target_id"), config.get("layer_ids"), config.get("hidden_size"),
                   config.get("vocab_size"), ds.get("n_samples"), ds.get("fingerprint"), config.get("revoke") is True)


@dataclass(frozen=True)
class Group:
    """`config.group`: a rank its consumers arranged outside the broker (values as sent)."""

    rank: object
    world_size: object


@dataclass(frozen=True)
class ConsumerStatement:
    """A consumer's hello: whether it trains (states a `signal`), its target, group, lineages and dist_addr."""

    trains: bool = False
    target: object = None
    group: Group | None = None
    lineages: bool = False
    dist_addr: object = None

    @classmethod
    def read(cls, config: dict) -> ConsumerStatement:
        signal, group = config.get("signal"), config.get("group")
        return cls("signal" in config, signal.get("target") if isinstance(signal, dict) else None,
                   Group(group.get("rank"), group.get("world_size")) if isinstance(group, dict) else None,
                   config.get("lineages") is True, config.get("dist_addr"))
