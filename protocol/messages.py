"""Every message type with its required and optional fields, and the wire limits (PROTOCOL.md is normative).

A message is a msgpack map (the header) followed by zero or more raw tensor frames
described in order by ``header["tensors"]``. This module only knows headers; the codec
(codec.py) knows frames.
"""

from dataclasses import Field, dataclass, field, fields, replace
from typing import ClassVar

from .errors import ProtocolError

PROTOCOL_VERSION = 1

# Caps on what a peer can make a receiver hold or parse (see PROTOCOL.md "Limits").
MAX_HEADER_BYTES = 1 << 20  # 1 MiB: a batch header lists sample IDs, nothing bulky
MAX_TENSORS = 16
MAX_NDIM = 8
MAX_MESSAGE_BYTES = 1 << 30  # 1 GiB: docs/DESIGN.md keeps one message well under this
# ZMQ_MAXMSGSIZE on both ends of the control socket: the header limit plus framing margin
# (a control message is a header only, so this is the largest frame either side accepts).
CONTROL_MAX_BYTES = MAX_HEADER_BYTES + 64 * 1024

# ZMTP metadata properties a producer's data-in connection announces (PROTOCOL.md 1): its
# peer ID and instance name, so that the broker can name the sender of any message on it.
PEER_PROPERTY, INSTANCE_PROPERTY = "X-Peer", "X-Instance"

# Every message type, one frozen dataclass each: required fields first (no default; the
# annotation is the msgpack type a receiver accepts), then optional ones (a default, and
# `optional()`'s rules for parsing and sending). docs/PROTOCOL.md's tables mirror these
# (tests/protocol/test_protocol_doc.py). Unknown header fields are ignored (forward compatible).

# A required field's annotation -> the python types a received value may have
# (a msgpack int is a valid float; a bool is never an int: checked apart).
_WIRE_TYPES = {str: (str,), int: (int,), float: (int, float), bool: (bool,), list: (list,), dict: (dict,)}


def optional(default=None, *, factory=None, parse=None, nil: bool = False):
    """An optional field. Received, it is `parse(value)` when present (as it came without
    `parse`), else the default. Sent, it is left out while None, unless `nil`: then it
    goes out as nil too (the fields PROTOCOL.md says are nil when unknown)."""
    meta = {"optional": True, "parse": parse, "nil": nil}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def local(**kw):
    """A field a receiver keeps beside the header's (keyword only, never on the wire)."""
    return field(kw_only=True, metadata={"local": True}, **kw)


def items(*types: type):
    """A required list field whose every element must be one of `types` (a bool is never an int)."""
    return field(metadata={"items": types})


def _is(value, types: tuple[type, ...]) -> bool:
    return isinstance(value, types) and (value.__class__ is not bool or bool in types)


def typed(*types: type, each: tuple[type, ...] | None = None):
    """An optional field's parse: the value as it came if nil or one of `types` (and, for a
    list, each element one of `each`); anything else is refused, naming what it is."""
    def parse(value):
        if value is None:
            return None
        if not _is(value, types):
            raise ProtocolError(f"has type {type(value).__name__}")
        if each is not None and not all(_is(v, each) for v in value):
            raise ProtocolError(f"holds an element of type {next(type(v).__name__ for v in value if not _is(v, each))}")
        return value
    return parse


def nested(cls: "type[Fields]"):
    """An optional field's parse: a map of `cls`'s fields, checked and parsed as `cls`; nil is None."""
    def parse(value):
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ProtocolError(f"has type {type(value).__name__}, not a map")
        try:
            return cls.from_header(value)
        except ProtocolError as e:
            raise ProtocolError(f"({e.reason})") from None
    return parse


@dataclass(frozen=True)
class Fields:
    """A typed msgpack map: a message's header (`Message`), or a map inside one (welcome's
    `run_config`). `raw` is the map it was parsed from ({} when built here): what a
    `reject` echoes and log lines quote. A field whose value is a `Fields` goes on the wire
    as its own map."""

    where: ClassVar[str] = ""  # how errors name this map ("" inside another: that one names it)
    raw: dict = field(default_factory=dict, repr=False, compare=False, kw_only=True)

    @classmethod
    def wire_fields(cls) -> tuple[Field, ...]:
        """The map's fields: not `raw`, nor what a receiver keeps beside them (`local`)."""
        return tuple(f for f in fields(cls) if f.name != "raw" and not f.metadata.get("local"))

    @classmethod
    def required(cls) -> dict[str, tuple[type, ...]]:
        """Required field -> the python types a received value may have."""
        return _plan(cls).required

    @classmethod
    def _label(cls, name: str) -> str:
        return f"{cls.where}: {name}" if cls.where else name

    @classmethod
    def check(cls, h: dict) -> None:
        """Raise ProtocolError unless every required field is in `h` with an accepted type
        (and, for a list of `items(...)`, every element of it)."""
        plan = _plan(cls)
        for name, types in plan.required.items():
            val = h.get(name, _MISSING)
            if val is _MISSING:
                raise ProtocolError(cls._label(f"missing field {name!r}"))
            if not isinstance(val, types) or (val.__class__ is bool and bool not in types):
                raise ProtocolError(cls._label(f"field {name!r} has type {type(val).__name__}"))
        for name, types in plan.items:
            bad = next((v for v in h[name] if not _is(v, types)), _MISSING)
            if bad is not _MISSING:
                raise ProtocolError(cls._label(f"field {name!r} holds an element of type {type(bad).__name__}"))

    @classmethod
    def from_header(cls, h: dict, **extra):
        """The map `h` as this type, checked as `check` does, each optional field present
        parsed (a parse that refuses its value names the field); `extra`: fields a subclass
        adds beside the wire's (broker/inbound.py's Batch: its frames and sizes)."""
        cls.check(h)
        plan = _plan(cls)
        # required fields positionally (they come first), optional ones only when present
        kw = {name: cls._parse(name, parse, h[name]) if parse else h[name] for name, parse in plan.optional
              if name in h}
        return cls(*[h[name] for name in plan.required], **kw, **extra, raw=h)

    @classmethod
    def _parse(cls, name: str, parse, value):
        try:
            return parse(value)
        except ProtocolError as e:
            raise ProtocolError(cls._label(f"field {name!r} {e.reason}")) from None

    def fields(self) -> dict:
        """The fields as they go on the wire: an optional one left out while None (unless nil)."""
        out = {}
        for name, keep_none in _plan(type(self)).sent:
            val = getattr(self, name)
            if val is not None or keep_none:
                out[name] = val.fields() if isinstance(val, Fields) else val
        return out


@dataclass(frozen=True)
class Message(Fields):
    """One header's fields. The envelope (`v`, `type`, the run ID after the handshake,
    `tensors`) is the codec's and `to_header`'s, not a field."""

    type: ClassVar[str] = ""

    @classmethod
    def _label(cls, name: str) -> str:
        return f"{cls.type}: {name}"

    def to_header(self, run: str | None = None) -> dict:
        """The header for the codec: version, type, `run` (after the handshake), the fields."""
        h = header(self.type, run)
        h.update(self.fields())  # welcome's and hello's `run` is a field of their own
        return h


class _Plan:
    """What `check`, `from_header` and `fields` need of a message class, worked out once
    (dataclasses.fields on every message was most of the broker's cost per batch)."""

    def __init__(self, cls: type[Fields]):
        wire = cls.wire_fields()
        self.required = {f.name: _WIRE_TYPES[f.type] for f in wire if not f.metadata.get("optional")}
        self.items = tuple((f.name, f.metadata["items"]) for f in wire if f.metadata.get("items"))
        self.optional = tuple((f.name, f.metadata["parse"]) for f in wire if f.metadata.get("optional"))
        # (name, sent when None): required fields always go out, optional ones per `nil`
        self.sent = tuple((f.name, not f.metadata.get("optional") or f.metadata["nil"]) for f in wire)


_PLANS: dict[type, _Plan] = {}
_MISSING = object()


def _plan(cls: type[Fields]) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _Plan(cls)
    return plan


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
    """`release {lease, samples}`: a producer's answer to `revoke`: the samples of its lease
    it will not make (none started), for the broker to lease to another producer."""

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
    # broker -> peer: the samples the run plans to train, in samples.done's count (the lr
    # schedule's length: --time-budget's plan, else epochs x samples); nil until known
    planned_samples: int | None = optional(parse=typed(int))
    # broker -> peer, --time-budget only: the share of the run's training time gone, by the
    # broker's clock (0 at the first trained sample, 1 at the deadline less the reserve): the
    # lr schedule's progress, so that it anneals at the deadline whatever the pace did
    budget_progress: float | None = optional(parse=typed(float, int))


@dataclass(frozen=True)
class Bye(Message):
    type: ClassVar[str] = "bye"
    reason: str


@dataclass(frozen=True)
class Failed(Message):
    """`failed {code, reason, ...}`: a peer that stops on an error says why, just before its
    `bye` (PROTOCOL.md 4.2): the broker's status and diagnosis show the cause and the fix
    instead of an unexplained departure, and a consumer names the batch that failed it."""

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
    """`revoke {lease, n}`: to a producer that said `config.revoke: true`, while another
    producer has nothing to make: give back up to `n` samples of `lease` not started, from
    its end (answered by `release`)."""

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
    """The facts a run's first producer fixes, each nil until then: in `run_config`, and in
    the broker's heartbeat (`stats.run_facts`) for a consumer that joined before any producer."""

    layer_ids: list | None = optional(parse=typed(list, each=(int,)))
    hidden_size: int | None = optional(parse=typed(int))
    target_id: dict | None = optional(parse=typed(dict))  # {model_type, config_sha256, heads_sha256}
    vocab_size: int | None = optional(parse=typed(int))


@dataclass(frozen=True)
class RunConfig(Fields):
    """`welcome.run_config`: the run's fixed facts (PROTOCOL.md 4.1). The broker builds it,
    producers and consumers parse it; what a field means is in PROTOCOL.md's table."""

    epochs: int
    seed: int
    lease_size: int
    max_message_bytes: int
    max_credit: int
    # the run's facts, absent until its first producer fixed them
    target: str | None = optional(parse=typed(str))
    target_id: dict | None = optional(parse=typed(dict))
    layer_ids: list | None = optional(parse=typed(list, each=(int,)))
    hidden_size: int | None = optional(parse=typed(int))
    vocab_size: int | None = optional(parse=typed(int))
    dataset: DatasetFacts | None = optional(parse=nested(DatasetFacts))
    # a resumed run: its parent, and (also in any run that recorded a commit) where to start
    parent_run: str | None = optional(parse=typed(str))
    resumed_from: CommitPoint | None = optional(parse=nested(CommitPoint))
    # consumers, where the broker arranges data-parallel ranks
    rank: int | None = optional(parse=typed(int))
    world_size: int | None = optional(parse=typed(int))
    dist: str | None = optional(parse=typed(str))
    lighthouse: str | None = optional(parse=typed(str))

    def fields(self) -> dict:
        """As Fields.fields, but nil, not absent, where a field applies and is unknown
        (PROTOCOL.md 4.1): a resumed run's `resumed_from` (its chain committed nothing), and
        `dist` where ranks are arranged (rank 0 offered no rendezvous)."""
        out = super().fields()
        if self.parent_run is not None:
            out.setdefault("resumed_from", None)
        if self.world_size is not None:
            out.setdefault("dist", None)
        return out

    def names_start(self) -> bool:
        """Whether the broker names the checkpoint to start from (`resumed_from`: None means
        none): a resumed run always does, any other run once it recorded a commit."""
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
        """The data endpoints to connect: `data_streams`, else the one `single` endpoint
        (`data_in` or `data_out`) a broker that names no streams sends. Raises ProtocolError
        when there is neither."""
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


# ---------------------------------------------------------------- data plane


@dataclass(frozen=True)
class Batch(Message):
    """One batch of hidden states (PROTOCOL.md 5): its header's fields and, beside them, its
    `tensors` by name (`input_ids`, `loss_mask`, `hidden`, ...). A producer builds it, its
    link sends the tensors as frames, a consumer's link reads it back with the tensors as
    read-only views of those frames. The broker relays the frames unread: its batches
    (broker/inbound.py) keep the frames and leave `tensors` empty."""

    type: ClassVar[str] = "batch"
    batch_id: str
    producer: str
    lease: int
    epoch: int
    samples: list
    seq_lens: list
    layer_ids: list
    hidden_encoding: str | None = optional()  # raw when absent
    tensors: dict = local(default_factory=dict, repr=False)

    @property
    def tokens(self) -> int:
        """T, the tokens packed in this batch (its sequences' lengths summed)."""
        return int(sum(self.seq_lens))


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


def header(type_: str, run: str | None = None, **fields) -> dict:
    """Build a header map with the version, type and (after the handshake) run ID."""
    h = {"v": PROTOCOL_VERSION, "type": type_}
    if run is not None:
        h["run"] = run
    h.update(fields)
    return h
