"""What a peer states in its `hello.config` (PROTOCOL.md 4.1), read once into typed fields.

The config is a map the peer chose: these readers never raise. A value is kept as the peer
sent it (a string where a count belongs, say); the rules that judge it (facts.py for a
producer's target and dataset, handshake.py for a consumer's group) name it in their
refusal. Only the log line quotes the raw map (handshake.brief).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProducerStatement:
    """A producer's target and dataset: `target`, `target_id`, `layer_ids`, `hidden_size`,
    `vocab_size`, and `dataset` {n_samples, fingerprint} (each None where it says nothing)."""

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
    """A consumer's hello: whether it trains a drafter (it states a training `signal`), that
    signal's `target` identity, its `group` (ranks arranged outside the broker), whether it
    announces `lineages`, and the rendezvous `dist_addr` it offers as rank 0."""

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
