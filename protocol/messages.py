"""Every message type with its required and optional fields, and the wire limits (PROTOCOL.md is normative).
This module knows headers only; codec.py knows frames."""

from dataclasses import dataclass, replace
from typing import ClassVar

from .batch import Batch
from .errors import ProtocolError
# how every message type is declared (fields.py); importers of the protocol read them here too
from .fields import PROTOCOL_VERSION, Fields, Message, header, items, local, nested, optional, typed  # noqa: F401

# Caps on what a peer can make a receiver hold or parse (see PROTOCOL.md "Limits").
MAX_HEADER_BYTES = 1 << 20  # 1 MiB: a batch header lists sample IDs, nothing bulky
MAX_TENSORS = 16
MAX_NDIM = 8
MAX_MESSAGE_BYTES = 1 << 30  # 1 GiB: docs/DESIGN.md keeps one message well under this
# ZMQ_MAXMSGSIZE of the control socket: a control message is a header only, plus framing margin
CONTROL_MAX_BYTES = MAX_HEADER_BYTES + 64 * 1024

# ZMTP metadata a producer's data-in connection announces (PROTOCOL.md 1), naming the sender
PEER_PROPERTY, INSTANCE_PROPERTY = "X-Peer", "X-Instance"

# ---------------------------------------------------------------- control, peer -> broker


@dataclass(frozen=True)
class Hello(Message):
    """The first message of every producer or consumer (PROTOCOL.md 4.1)."""

    type: ClassVar[str] = "hello"
    role: str
    instance: str
    host: str
    pid: int
    gpu: int | None = optional(parse=lambda v: v if isinstance(v, int) else None, nil=True)
    run: str | None = optional()  # the run the peer means to join
    config: dict = optional(factory=dict, parse=lambda v: v or {})  # a non-map is refused by the broker


@dataclass(frozen=True)
class LeaseAsk(Message):
    """`lease {want}`: a producer asks for up to `want` samples."""

    type: ClassVar[str] = "lease"
    want: int


@dataclass(frozen=True)
class Done(Message):
    """`done {lease, skipped}`: a producer made what it could of a lease."""

    type: ClassVar[str] = "done"
    lease: int
    skipped: list  # [sample, reason] pairs


@dataclass(frozen=True)
class Release(Message):
    """`release {lease, samples}`: a producer's answer to `revoke`, the samples it will not make."""

    type: ClassVar[str] = "release"
    lease: int
    samples: list = items(int)


@dataclass(frozen=True)
class Credit(Message):
    type: ClassVar[str] = "credit"
    credit: int


@dataclass(frozen=True)
class Ack(Message):
    type: ClassVar[str] = "ack"
    batch_ids: list
    step: int
    lineage: object = optional()  # a str names the lineage; anything else is the default one


@dataclass(frozen=True)
class Commit(Message):
    type: ClassVar[str] = "commit"
    step: int
    checkpoint: str
    lineage: object = optional()  # as in Ack


@dataclass(frozen=True)
class LineageStart(Message):
    """`lineage {lineage, step, parent, checkpoint}`: a consumer starts new weights."""

    type: ClassVar[str] = "lineage"
    lineage: str
    step: int
    parent: object = optional(nil=True)  # the lineage it starts from (a str), else from nothing
    checkpoint: str | None = optional(nil=True)  # the checkpoint it loaded, for log lines


@dataclass(frozen=True)
class Heartbeat(Message):
    """Both ways: a peer's figures to the broker, the broker's queue and progress to peers."""

    type: ClassVar[str] = "heartbeat"
    stats: dict
    # broker -> peer: the samples the run plans to train (the lr schedule's length); nil until known
    planned_samples: int | None = optional(parse=typed(int))
    # broker -> peer, --time-budget only: the lr schedule's progress by the broker's clock, so it
    # anneals at the deadline whatever the pace did
    budget_progress: float | None = optional(parse=typed(float, int))


@dataclass(frozen=True)
class Bye(Message):
    type: ClassVar[str] = "bye"
    reason: str


@dataclass(frozen=True)
class Failed(Message):
    """`failed {code, reason, ...}`: a peer that stops on an error says why before its `bye` (PROTOCOL.md 4.2)."""

    type: ClassVar[str] = "failed"
    code: str  # bad_row (producer), bad_batch (consumer), error (anything else)
    reason: str  # the error, as the peer logged it
    hint: str | None = optional()  # what fixes it
    source: str | None = optional()  # bad_row: the row's `file:line`
    batch_id: str | None = optional()  # bad_batch: the batch this consumer could not train
    fault: str | None = optional()  # bad_batch: what is wrong with it (hidden_width, token_ids, ...)


@dataclass(frozen=True)
class StatusAsk(Message):
    """`status {}`: any DEALER, no handshake."""

    type: ClassVar[str] = "status"


# ---------------------------------------------------------------- control, broker -> peer


@dataclass(frozen=True)
class Revoke(Message):
    """`revoke {lease, n}`: give back up to `n` unstarted samples of `lease` for an idle producer."""

    type: ClassVar[str] = "revoke"
    lease: int
    n: int


@dataclass(frozen=True)
class DatasetFacts(Fields):
    """`run_config.dataset`: the size (and fingerprint, if its producer states one) of the run's dataset."""

    n_samples: int
    fingerprint: str | None = optional(parse=typed(str))


@dataclass(frozen=True)
class CommitPoint(Fields):
    """`run_config.resumed_from`: the commit a consumer starts from (PROTOCOL.md 8)."""

    run: str
    step: int
    checkpoint: str


@dataclass(frozen=True)
class RunFacts(Fields):
    """The facts a run's first producer fixes, nil until then (also in the heartbeat's `stats.run_facts`)."""

    layer_ids: list | None = optional(parse=typed(list, each=(int,)))
    hidden_size: int | None = optional(parse=typed(int))
    target_id: dict | None = optional(parse=typed(dict))  # {model_type, config_sha256, heads_sha256}
    vocab_size: int | None = optional(parse=typed(int))


@dataclass(frozen=True)
class RunConfig(Fields):
    """`welcome.run_config`: the run's fixed facts (PROTOCOL.md 4.1 says what each field means)."""

    epochs: int
    seed: int
    lease_size: int
    max_message_bytes: int
    max_credit: int
    target: str | None = optional(parse=typed(str))
    target_id: dict | None = optional(parse=typed(dict))
    layer_ids: list | None = optional(parse=typed(list, each=(int,)))
    hidden_size: int | None = optional(parse=typed(int))
    vocab_size: int | None = optional(parse=typed(int))
    dataset: DatasetFacts | None = optional(parse=nested(DatasetFacts))
    parent_run: str | None = optional(parse=typed(str))
    resumed_from: CommitPoint | None = optional(parse=nested(CommitPoint))
    rank: int | None = optional(parse=typed(int))
    world_size: int | None = optional(parse=typed(int))
    dist: str | None = optional(parse=typed(str))
    lighthouse: str | None = optional(parse=typed(str))

    def fields(self) -> dict:
        """As Fields.fields, but nil, not absent, where a field applies and is unknown (PROTOCOL.md 4.1)."""
        out = super().fields()
        if self.parent_run is not None:
            out.setdefault("resumed_from", None)
        if self.world_size is not None:
            out.setdefault("dist", None)
        return out

    def names_start(self) -> bool:
        """Whether the broker names the checkpoint to start from (a resumed run, or one with a commit)."""
        return self.parent_run is not None or self.resumed_from is not None

    def with_facts(self, facts: RunFacts) -> "RunConfig":
        """This run config with the facts `facts` knows (a later heartbeat's) filled in."""
        known = {k: v for k, v in facts.fields().items() if v is not None}
        return replace(self, **known)


@dataclass(frozen=True)
class Welcome(Message):
    type: ClassVar[str] = "welcome"
    run: str
    peer: str
    heartbeat_s: float
    timeout_s: float
    data_in: str | None = optional(parse=typed(str))  # producers
    data_out: str | None = optional(parse=typed(str))  # consumers: the first of data_streams
    data_streams: list | None = optional(parse=typed(list, each=(str,)))
    run_config: RunConfig | None = optional(parse=nested(RunConfig))

    def streams(self, single: str | None) -> list[str]:
        """The data endpoints to connect: `data_streams`, else `single`; ProtocolError when neither."""
        if self.data_streams:
            return list(self.data_streams)
        if single is None:
            raise ProtocolError("welcome: no data endpoint (data_streams, data_in or data_out)", peer="broker")
        return [single]


@dataclass(frozen=True)
class Reject(Message):
    type: ClassVar[str] = "reject"
    reason: str
    code: str
    answers: dict | None = optional(parse=typed(dict))  # the refused message's type and identifying fields


@dataclass(frozen=True)
class Grant(Message):
    type: ClassVar[str] = "grant"
    lease: int
    epoch: int
    samples: list = items(int)
    end: bool
    retry_ms: int | None = optional(parse=typed(int))  # an empty grant without end: ask again after this


@dataclass(frozen=True)
class Stop(Message):
    type: ClassVar[str] = "stop"
    reason: str


@dataclass(frozen=True)
class StatusReply(Message):
    type: ClassVar[str] = "status_reply"
    status: dict


MESSAGES: dict[str, type[Message]] = {
    cls.type: cls for cls in (Hello, LeaseAsk, Done, Release, Revoke, Credit, Ack, Commit, LineageStart, Heartbeat, Bye, Failed,
                              StatusAsk, Welcome, Reject, Grant, Stop, StatusReply, Batch)
}

# Messages that may be sent before a run ID is known; every other one carries `run`.
PRE_HANDSHAKE = frozenset({"hello", "welcome", "reject", "status", "status_reply"})

CONTROL_TO_BROKER = frozenset(
    {"hello", "lease", "done", "release", "credit", "ack", "commit", "lineage", "heartbeat", "bye", "failed", "status"}
)
CONTROL_FROM_BROKER = frozenset({"welcome", "reject", "grant", "revoke", "stop", "status_reply", "heartbeat"})
DATA = frozenset({"batch"})

ROLES = ("producer", "consumer", "status")
