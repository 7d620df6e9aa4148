"""Message types and the header schema of every message (docs/PROTOCOL.md is normative).

A message is a msgpack map (the header) followed by zero or more raw tensor frames
described in order by ``header["tensors"]``. This module only knows headers; the codec
(codec.py) knows frames.
"""

from __future__ import annotations

PROTOCOL_VERSION = 1

# Caps on what a peer can make a receiver hold or parse (see PROTOCOL.md "Limits").
MAX_HEADER_BYTES = 1 << 20  # 1 MiB: a batch header lists sample IDs, nothing bulky
MAX_TENSORS = 16
MAX_NDIM = 8
MAX_MESSAGE_BYTES = 1 << 30  # 1 GiB: docs/DESIGN.md keeps one message well under this
# ZMQ_MAXMSGSIZE on both ends of the control socket: the header limit plus framing margin
# (a control message is a header only, so this is the largest frame either side accepts).
CONTROL_MAX_BYTES = MAX_HEADER_BYTES + 64 * 1024

# type -> {field: accepted python types}. Fields listed here are required; others
# are optional and ignored by receivers that do not know them (forward compatible).
_STR = (str,)
_INT = (int,)
_NUM = (int, float)
_LIST = (list,)
_MAP = (dict,)

SCHEMAS: dict[str, dict[str, tuple[type, ...]]] = {
    # control plane, peer -> broker
    "hello": {"role": _STR, "instance": _STR, "host": _STR, "pid": _INT},
    "lease": {"want": _INT},
    "done": {"lease": _INT, "skipped": _LIST},
    "credit": {"credit": _INT},
    "ack": {"batch_ids": _LIST, "step": _INT},
    "commit": {"step": _INT, "checkpoint": _STR},
    "lineage": {"lineage": _STR, "step": _INT},
    "heartbeat": {"stats": _MAP},
    "bye": {"reason": _STR},
    "status": {},
    # control plane, broker -> peer
    "welcome": {"run": _STR, "peer": _STR, "heartbeat_s": _NUM, "timeout_s": _NUM},
    "reject": {"reason": _STR, "code": _STR},
    "grant": {"lease": _INT, "epoch": _INT, "samples": _LIST, "end": (bool,)},
    "stop": {"reason": _STR},
    "status_reply": {"status": _MAP},
    # data plane
    "batch": {
        "batch_id": _STR,
        "producer": _STR,
        "lease": _INT,
        "epoch": _INT,
        "samples": _LIST,
        "seq_lens": _LIST,
        "layer_ids": _LIST,
    },
}

# Messages that may be sent before a run ID is known; every other one carries `run`.
PRE_HANDSHAKE = frozenset({"hello", "welcome", "reject", "status", "status_reply"})

CONTROL_TO_BROKER = frozenset(
    {"hello", "lease", "done", "credit", "ack", "commit", "lineage", "heartbeat", "bye", "status"}
)
CONTROL_FROM_BROKER = frozenset({"welcome", "reject", "grant", "stop", "status_reply", "heartbeat"})
DATA = frozenset({"batch"})

ROLES = ("producer", "consumer", "status")


def header(type_: str, run: str | None = None, **fields) -> dict:
    """Build a header map with the version, type and (after the handshake) run ID."""
    h = {"v": PROTOCOL_VERSION, "type": type_}
    if run is not None:
        h["run"] = run
    h.update(fields)
    return h
