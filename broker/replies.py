"""Refusals: `reject` answers and their log lines, rate-limited and clipped so a flood of bad
messages cannot become a log or send storm; every part asks `Replies.allow` first."""

from __future__ import annotations

from collections import Counter

from dflash.protocol.messages import Reject
from dflash.runtime.logs import get_logger

from .actions import Outbox
from .liveness import Every, RateLimit

log = get_logger()

SENDER_LINES_PER_S = 5.0  # one noisy sender cannot take the whole budget of a kind...
KIND_LINES_PER_S = 20.0  # ...and a flood from invented senders cannot make a log storm


MAX_REASON = 300  # reasons quote what the peer sent (a type, a run ID): never let it be 1 MiB


def clip(x, n: int = 128):
    """A peer-chosen header value fit for a log line: long strings cut, non-scalars by type name."""
    if x is None or isinstance(x, (bool, int, float)):
        return x
    if isinstance(x, str):
        return x if len(x) <= n else x[:n] + f"...(+{len(x) - n})"
    return f"<{type(x).__name__}>"


class LogGate:
    """Rate limit of warning lines per "kind:sender" AND per kind (senders name themselves, so invented
    names would pass a per-sender limit); `allow` -> (allowed, suppressed since the last)."""

    def __init__(self, now: float, per_sender: float = SENDER_LINES_PER_S, per_kind: float = KIND_LINES_PER_S,
                 report_s: float = 5.0):
        self._senders, self._kinds = RateLimit(per_sender), RateLimit(per_kind, max_keys=64)
        self._suppressed: Counter[str] = Counter()
        self._report = Every(report_s, now)

    def allow(self, key: str, now: float) -> tuple[bool, int]:
        kind = key.split(":", 1)[0]
        if self._senders.allow(key, now)[0] and self._kinds.allow(kind, now)[0]:
            return True, self._suppressed.pop(kind, 0)
        self._suppressed[kind] += 1
        return False, 0

    def report(self, now: float, force: bool = False) -> None:
        """Every `report_s` (or if `force`), log what was suppressed: no later line may count it."""
        if self._suppressed and (self._report.due(now) or force):
            log.warning("broker.log_suppressed", counts=dict(self._suppressed), total=sum(self._suppressed.values()))
            self._suppressed.clear()


# Header fields a reject echoes in `answers`, so a peer knows which of its messages was refused.
ECHO_FIELDS = ("type", "step", "lease", "want", "credit", "checkpoint")


def answers(h: dict | None) -> dict | None:
    """The refused message's type and identifying fields (clipped); None if its header did not parse."""
    if not isinstance(h, dict) or "type" not in h:
        return None
    out = {k: clip(h[k], 64) for k in ECHO_FIELDS if k in h}
    if isinstance(h.get("batch_ids"), list):
        out["batch_ids"] = [clip(x, 64) for x in h["batch_ids"][:4]]
        out["n_batch_ids"] = len(h["batch_ids"])
    return out


class Replies:
    """`reject` answers and the warning lines a peer can cause, rate-limited."""

    def __init__(self, out: Outbox, now: float):
        self.out = out
        self.gate, self.replies = LogGate(now), RateLimit(3.0)

    def allow(self, key: str, now: float) -> tuple[bool, int]:
        """(may log `key` now, how many of its kind were left out since)."""
        return self.gate.allow(key, now)

    def reply(self, identity: bytes, msg: Reject, now: float) -> None:
        """Send `msg` unless `identity` had its share of replies this second."""
        if self.replies.allow(identity.hex(), now)[0]:
            self.out.send(identity, msg)

    def refuse(self, identity: bytes, code: str, reason: str, h: dict | None, now: float) -> None:
        """Answer `reject {code, reason, answers}` and log broker.peer_rejected."""
        key = identity.hex()[:64]
        reason = clip(reason, MAX_REASON)
        ok, suppressed = self.gate.allow(f"reject:{key}", now)
        if ok:
            h = h or {}
            log.warning("broker.peer_rejected", code=code, reason=reason, identity=key, type=clip(h.get("type")),
                        peer_role=clip(h.get("role")), peer_instance=clip(h.get("instance")),
                        peer_host=clip(h.get("host")), peer_pid=clip(h.get("pid")), suppressed=suppressed)
        if self.replies.allow(key, now)[0]:
            self.out.send(identity, Reject(reason, code, answers(h)))

    def bad_message(self, identity: bytes, who: str, reason: str, h: dict | None, now: float) -> None:
        """A control message failed validation: log it and answer `reject {code: bad_message}`."""
        self.log_bad("control", who, reason, now)
        if self.replies.allow(identity.hex(), now)[0]:
            self.out.send(identity, Reject(f"bad message: {reason}", "bad_message", answers(h)))

    def log_bad(self, socket: str, who: str, reason: str, now: float, **conn) -> None:
        """broker.bad_message, rate-limited; `conn`: on data in, the connection it came on."""
        who = clip(who)
        ok, suppressed = self.gate.allow(f"bad:{socket}:{who}", now)
        if ok:
            log.warning("broker.bad_message", socket=socket, peer=who, reason=clip(reason, MAX_REASON), **conn,
                        suppressed=suppressed)
