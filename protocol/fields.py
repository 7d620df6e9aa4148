"""Typed msgpack maps: how every message type declares its fields, and how a header is checked and parsed.

A message is a frozen dataclass: required fields (annotation = accepted msgpack type), then
`optional()` ones, then `local()` ones never on the wire. Unknown header fields are ignored.
"""

from dataclasses import Field, dataclass, field, fields
from typing import ClassVar

from .errors import ProtocolError

PROTOCOL_VERSION = 1

# annotation -> accepted python types (an int is a valid float; a bool is never an int)
_WIRE_TYPES = {str: (str,), int: (int,), float: (int, float), bool: (bool,), list: (list,), dict: (dict,)}


def optional(default=None, *, factory=None, parse=None, nil: bool = False):
    """An optional field: received, `parse(value)` when present, else the default; sent, left out
    while None unless `nil`."""
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
    """An optional field's parse accepting nil or one of `types` (a list's elements of `each`)."""
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
    """A typed msgpack map: a message's header, or a map inside one; `raw` is the map it was parsed from."""

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
        """Raise ProtocolError unless every required field is in `h` with an accepted type."""
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
        """The map `h` as this type, checked and parsed; `extra`: the `local` fields."""
        cls.check(h)
        plan = _plan(cls)
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
    """One header's fields; the envelope (`v`, `type`, `run`, `tensors`) is not a field."""

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
    """What `check`, `from_header` and `fields` need of a class, worked out once: dataclasses.fields
    per message was most of the broker's cost per batch."""

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




def header(type_: str, run: str | None = None, **fields) -> dict:
    """Build a header map with the version, type and (after the handshake) run ID."""
    h = {"v": PROTOCOL_VERSION, "type": type_}
    if run is not None:
        h["run"] = run
    h.update(fields)
    return h
