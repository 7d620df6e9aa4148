"""Refusals: `reject` answers and the log lines that go with them, both rate-limited per
sender so a flood of bad messages cannot become a log storm or a send storm."""

from __future__ import annotations

from dflash.protocol.logs import get_logger

log = get_logger()


def refuse(b, identity: bytes, code: str, reason: str, h: dict | None = None) -> None:
    """Answer `reject {code, reason}` and log broker.peer_rejected."""
    key = identity.hex()
    ok, suppressed = b.log_limit.allow(f"reject:{key}")
    if ok:
        h = h or {}
        log.warning("broker.peer_rejected", code=code, reason=reason, identity=key, type=h.get("type"),
                    peer_role=h.get("role"), peer_instance=h.get("instance"), peer_host=h.get("host"),
                    peer_pid=h.get("pid"), suppressed=suppressed)
    if b.reply_limit.allow(key)[0]:
        b.send(identity, "reject", reason=reason, code=code)


def bad_message(b, identity: bytes, who: str, reason: str) -> None:
    """A control message failed validation: log it, answer `reject {code: bad_message}`."""
    log_bad(b, "control", who, reason)
    if b.reply_limit.allow(identity.hex())[0]:
        b.send(identity, "reject", reason=f"bad message: {reason}", code="bad_message")


def log_bad(b, socket: str, who: str, reason: str) -> None:
    """broker.bad_message, at most a few lines per second per sender, with a suppressed count."""
    ok, suppressed = b.log_limit.allow(f"bad:{socket}:{who}")
    if ok:
        log.warning("broker.bad_message", socket=socket, peer=who, reason=reason, suppressed=suppressed)
