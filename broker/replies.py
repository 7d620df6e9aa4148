"""Refusals: `reject` answers and the log lines that go with them, both rate-limited (per
sender, and log lines also per kind) and clipped, so a flood of bad messages cannot become
a log storm or a send storm."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from dflash.protocol.messages import Reject
from dflash.runtime.logs import get_logger

from .liveness import Every, RateLimit

if TYPE_CHECKING:  # the core calls these with itself; imported for the annotations only
    from .core import BrokerCore

log = get_logger()

SENDER_LINES_PER_S = 5.0  # one noisy sender cannot take the whole budget of a kind...
KIND_LINES_PER_S = 20.0  # ...and a flood from invented senders cannot make a log storm


MAX_REASON = 300  # reasons quote what the peer sent (a type, a run ID): never let it be 1 MiB


def clip(x, n: int = 128):
    """A header value fit for a log line: short strings and numbers as they are, longer
    strings cut, anything else by its type name (a peer chooses these values)."""
    if x is None or isinstance(x, (bool, int, float)):
        return x
    if isinstance(x, str):
        return x if len(x) <= n else x[:n] + f"...(+{len(x) - n})"
    return f"<{type(x).__name__}>"


class LogGate:
    """Rate limit of the warning lines a peer can cause, per sender AND per kind.

    Keys are "kind:sender" (e.g. "bad:control:c3", "stale:p1"). A per-sender limit alone
    is not enough: senders name themselves (ROUTER identities, a batch's `producer`
    field), so a flood of invented names would pass it. `allow` returns (allowed,
    suppressed): the lines of that kind left out since the last one logged.
    """

    def __init__(self, per_sender: float = SENDER_LINES_PER_S, per_kind: float = KIND_LINES_PER_S,
                 report_s: float = 5.0):
        self._senders, self._kinds = RateLimit(per_sender), RateLimit(per_kind, max_keys=64)
        self._suppressed: Counter[str] = Counter()
        self._report = Every(report_s)

    def allow(self, key: str) -> tuple[bool, int]:
        kind = key.split(":", 1)[0]
        if self._senders.allow(key)[0] and self._kinds.allow(kind)[0]:
            return True, self._suppressed.pop(kind, 0)
        self._suppressed[kind] += 1
        return False, 0

    def report(self, now: float, force: bool = False) -> None:
        """Every `report_s` (or now, if `force`), log what was suppressed and not yet
        counted in a later line: after a burst no line of its kind may follow."""
        if self._suppressed and (self._report.due(now) or force):
            log.warning("broker.log_suppressed", counts=dict(self._suppressed), total=sum(self._suppressed.values()))
            self._suppressed.clear()


# Header fields a reject echoes in `answers`, so a peer knows which of its messages was refused.
ECHO_FIELDS = ("type", "step", "lease", "want", "credit", "checkpoint")


def answers(h: dict | None) -> dict | None:
    """What a reject answers: the refused message's type and identifying fields (clipped),
    the first batch IDs of an ack; None if its header did not parse."""
    if not isinstance(h, dict) or "type" not in h:
        return None
    out = {k: clip(h[k], 64) for k in ECHO_FIELDS if k in h}
    if isinstance(h.get("batch_ids"), list):
        out["batch_ids"] = [clip(x, 64) for x in h["batch_ids"][:4]]
        out["n_batch_ids"] = len(h["batch_ids"])
    return out


def refuse(core: BrokerCore, identity: bytes, code: str, reason: str, h: dict | None = None) -> None:
    """Answer `reject {code, reason, answers}` and log broker.peer_rejected."""
    key = identity.hex()[:64]
    reason = clip(reason, MAX_REASON)
    ok, suppressed = core.log_limit.allow(f"reject:{key}")
    if ok:
        h = h or {}
        log.warning("broker.peer_rejected", code=code, reason=reason, identity=key, type=clip(h.get("type")),
                    peer_role=clip(h.get("role")), peer_instance=clip(h.get("instance")),
                    peer_host=clip(h.get("host")), peer_pid=clip(h.get("pid")), suppressed=suppressed)
    if core.reply_limit.allow(key)[0]:
        core.send(identity, Reject(reason, code, answers(h)))


def bad_message(core: BrokerCore, identity: bytes, who: str, reason: str, h: dict | None = None) -> None:
    """A control message failed validation: log it, answer `reject {code: bad_message}`
    (with `answers` when its header parsed)."""
    log_bad(core, "control", who, reason)
    if core.reply_limit.allow(identity.hex())[0]:
        core.send(identity, Reject(f"bad message: {reason}", "bad_message", answers(h)))


def log_bad(core: BrokerCore, socket: str, who: str, reason: str, **conn) -> None:
    """broker.bad_message, rate-limited by LogGate, with a suppressed count; `conn`: on data
    in, the connection it came on (intake.connection_fields)."""
    who = clip(who)
    ok, suppressed = core.log_limit.allow(f"bad:{socket}:{who}")
    if ok:
        log.warning("broker.bad_message", socket=socket, peer=who, reason=clip(reason, MAX_REASON), **conn,
                    suppressed=suppressed)
