"""Named failures every role can raise or catch."""


class DFlashError(Exception):
    """Base of every error this project raises on purpose."""


class ProtocolError(DFlashError):
    """A message broke the wire contract (docs/PROTOCOL.md); `reason` says how."""

    def __init__(self, reason: str, *, peer: str | None = None):
        self.reason = reason
        self.peer = peer
        super().__init__(f"{reason} (peer {peer})" if peer else reason)


class MessageTooLarge(DFlashError):
    """A message over the receiver's limit, refused before it leaves: the receiver's ZeroMQ would drop it silently."""


class BrokerUnreachable(DFlashError):
    """The broker did not answer the handshake in time."""


class Rejected(DFlashError):
    """The broker refused this peer (wrong version, another run's ID, duplicate ...)."""

    def __init__(self, reason: str, code: str = "rejected"):
        self.reason = reason
        self.code = code
        super().__init__(f"broker rejected us: {reason} [{code}]")


class RunMismatch(Rejected):
    """A peer asked to join a run other than the one the broker serves."""
