"""The rules of a `hello` that need no session table (PROTOCOL.md 4.1); sessions.py applies them."""

from __future__ import annotations

import json

from dflash.protocol.messages import Hello

from .config import MAX_HELLO_CONFIG_BYTES
from .peers import ConsumerSession, Session
from .statements import ConsumerStatement


def malformed(m: Hello) -> tuple[str, dict] | None:
    """Why hello `m` cannot be read at all, with the header to echo; None when it can."""
    h = m.raw
    if m.role not in ("producer", "consumer"):
        return f"role {m.role!r}: hello is for 'producer' or 'consumer'", h
    if not m.instance or len(m.instance) > 128 or not isinstance(m.config, dict):
        return "hello needs a non-empty instance (<=128 chars) and a map config", h
    if len(json.dumps(m.config, default=str)) > MAX_HELLO_CONFIG_BYTES:
        return f"hello config is larger than {MAX_HELLO_CONFIG_BYTES} bytes as JSON", {**h, "config": None}
    return None


def same_process(p: Session, m: Hello, key: str | None) -> bool:
    """Whether a hello comes from live session `p`'s very process on a new connection (same host, pid
    and Curve key): a reconnected DEALER gets a new ROUTER identity."""
    return m.host == p.host and m.pid == p.pid and isinstance(m.pid, int) and p.curve_key == key


def second_model(said: ConsumerStatement, consumers: list[ConsumerSession]) -> ConsumerSession | None:
    """With --consumers 0 a run trains one model: the live trainer a new one would not train with
    (self-arranged ranks of one group are one model), or None."""
    if not said.trains:  # not a drafter trainer (a data client, a test's fake)
        return None
    mine = said.group
    for other in consumers:
        if not other.said.trains:
            continue
        theirs = other.said.group
        same_group = (mine is not None and theirs is not None and mine.world_size == theirs.world_size
                      and mine.rank != theirs.rank)
        if not same_group:
            return other
    return None


def brief(config: dict) -> dict:
    """The hello config for the log line, or only its keys if it is large."""
    text = json.dumps(config, default=str)
    return config if len(text) <= 4000 else {"keys": sorted(config)[:64], "bytes": len(text)}


def dist_endpoint(addr) -> str | None:
    """rank 0's `config.dist_addr` ('host:port' or 'tcp://host:port') as tcp://host:port."""
    if not isinstance(addr, str) or not addr:
        return None
    return addr if addr.startswith("tcp://") else f"tcp://{addr}"


def pipe_thread(threads: list[int], in_use: list[int]) -> int:
    """The pipe thread fewest streams use: given the whole mask, libzmq put every connection on one thread."""
    return min(threads, key=in_use.count)
