"""Log events are a stable interface: docs/LOGS.md has a table row for every event the code
logs, and every row names an event the code still logs (no dead documentation).

The code is read with `ast`, not grepped: a call counts when it is a level method
(`info`, `warning`, ...) on a structlog logger, i.e. a name or attribute bound to
`get_logger()` (or `.bind()` of one) in that module. Event names are followed through
  - conditional expressions: `log.error("a" if x else "b", ...)` logs both;
  - level aliases: `level = log.info if quiet else log.warning; level("e", ...)`;
  - helpers that pass a parameter on as the event: `def _say(event, **kw): log.info(event, **kw)`
    counts every literal its callers pass.
An event the scanner cannot name is a failure of its own: write a literal, or list it in
DYNAMIC_EVENTS with the reason. So is `x.info("a.b", ...)` on an `x` not bound to a logger
in its module (a logger passed in as an argument), which would otherwise escape.

Besides the name, each row must give the call's level in its level column and every
keyword field in its fields column: literal keywords, and the keys of `**name` where the
same function sets `name = dict(k=...)` or `{"k": ...}`. Other spreads (a summary a method
returns, `vars(info)`) cannot be read statically; LOGS.md documents them by hand.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "LOGS.md"
# The folders pyproject maps into the `dflash` namespace, plus bench/ (it runs the roles).
SOURCE_DIRS = ("protocol", "runtime", "broker", "producers", "consumers", "decoding", "tools", "bench", "dflash_ns")
LEVEL_METHODS = {"debug": "debug", "info": "info", "msg": "info", "warning": "warning", "warn": "warning",
                 "error": "error", "exception": "error", "critical": "critical", "fatal": "critical"}
LEVEL_METHODS |= {"a" + k: v for k, v in LEVEL_METHODS.items()}  # structlog's async twins
# Logger methods that return a logger or log nothing.
OTHER_LOGGER_METHODS = {"bind", "unbind", "try_unbind", "new", "addHandler", "removeHandler", "setLevel", "addFilter",
                        "removeFilter"}
LOGGER_FACTORIES = {"get_logger", "getLogger"}
# "path:function" -> events, for a call whose event the scanner cannot work out. Each entry
# needs a comment saying why a literal is not possible. Empty: every event today is literal.
DYNAMIC_EVENTS: dict[str, set[str]] = {}


@dataclass
class Site:
    event: str
    where: str  # path:line
    levels: set[str]
    fields: list[str]


@dataclass
class Scan:
    sites: list[Site] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # calls whose event cannot be read


# ------------------------------------------------------------------ reading the code


def _dotted(node: ast.AST) -> str | None:
    """`log`, `self.log`: the name a logger or alias is bound to (cheaper than ast.unparse)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _called_name(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


_EVENT = re.compile(r"^[a-z_]+(?:\.[a-z0-9_]+)+$")


class Module:
    """One module, walked once: its calls, assignments, loggers, level aliases and, for
    every node, the function it sits in."""

    def __init__(self, path: str, text: str):
        self.path = path
        self.calls: list[ast.Call] = []
        self.assigns: list[tuple[str, ast.AST]] = []
        self.local: dict[tuple[int, str], list[ast.AST]] = {}  # (id(function), name) -> values
        self.function: dict[int, ast.FunctionDef | None] = {}  # id(call) -> enclosing function
        self._walk(ast.parse(text, filename=path), None)
        self.loggers = self._find_loggers()
        self.aliases = self._find_aliases()

    def _walk(self, node: ast.AST, fn) -> None:
        stack = [(node, fn)]
        while stack:
            node, fn = stack.pop()
            if isinstance(node, ast.Call):
                self.calls.append(node)
                self.function[id(node)] = fn
            elif isinstance(node, ast.Assign):
                self.assigns += [(_dotted(t), node.value) for t in node.targets if _dotted(t)]
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        self.local.setdefault((id(fn), t.id), []).append(node.value)
            elif isinstance(node, ast.AnnAssign) and node.value is not None and _dotted(node.target):
                self.assigns.append((_dotted(node.target), node.value))
            inner = node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            stack += [(child, inner) for child in ast.iter_child_nodes(node)]
        self.calls.sort(key=lambda c: (c.lineno, c.col_offset))

    def is_logger(self, node: ast.AST, names: set[str]) -> bool:
        """A logger name, `get_logger(...)`/`structlog.get_logger(...)`, or `.bind()` of a logger."""
        if _dotted(node) in names:
            return True
        if not isinstance(node, ast.Call):
            return False
        if _called_name(node) in LOGGER_FACTORIES:
            return True
        return isinstance(node.func, ast.Attribute) and node.func.attr in OTHER_LOGGER_METHODS and \
            self.is_logger(node.func.value, names)

    def _find_loggers(self) -> set[str]:
        names: set[str] = set()
        changed = True
        while changed:  # `child = log.bind(...)` makes `child` a logger once `log` is one
            changed = False
            for target, value in self.assigns:
                if target not in names and self.is_logger(value, names):
                    names.add(target)
                    changed = True
        return names

    def level_refs(self, node: ast.AST) -> set[str]:
        """Levels of every `<logger>.<level>` or `getattr(<logger>, "<level>")` inside `node`."""
        levels = set()
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and n.attr in LEVEL_METHODS and _dotted(n.value) in self.loggers:
                levels.add(LEVEL_METHODS[n.attr])
            elif isinstance(n, ast.Call) and _dotted(n.func) == "getattr" and len(n.args) >= 2 \
                    and _dotted(n.args[0]) in self.loggers:
                lv = n.args[1]
                levels.add(LEVEL_METHODS.get(lv.value, lv.value) if isinstance(lv, ast.Constant) else "?")
        return levels

    def _find_aliases(self) -> dict[str, set[str]]:
        """Names bound to a level method, e.g. `level = log.info if quiet else log.warning`."""
        out: dict[str, set[str]] = {}
        for target, value in self.assigns:
            if target not in self.loggers:
                levels = self.level_refs(value)
                if levels:
                    out.setdefault(target, set()).update(levels)
        return out

    def logging_calls(self):
        """(call, levels) for each logging call; (call, None) for an unknown logger method."""
        for call in self.calls:
            f = call.func
            if isinstance(f, ast.Attribute) and _dotted(f.value) in self.loggers:
                if f.attr in LEVEL_METHODS:
                    yield call, {LEVEL_METHODS[f.attr]}
                elif f.attr not in OTHER_LOGGER_METHODS:
                    yield call, None
            elif _dotted(f) in self.aliases:
                yield call, self.aliases[_dotted(f)]

    def spread_fields(self, value: ast.AST, fn) -> list[str]:
        """Keys of `**name` when `name` is set in the same function to `dict(k=...)` or
        `{"k": ...}` literals; nothing for other spreads (a summary a method returns)."""
        if not isinstance(value, ast.Name):
            return []
        keys: list[str] = []
        for v in self.local.get((id(fn), value.id), []):
            if isinstance(v, ast.Call) and _dotted(v.func) == "dict":
                keys += [k.arg for k in v.keywords if k.arg is not None]
            elif isinstance(v, ast.Dict):
                keys += [k.value for k in v.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        return keys

    def unknown_loggers(self) -> list[ast.Call]:
        """`x.info("a.b", ...)` where `x` is not known as a logger here (a logger passed in
        as an argument, imported from another module...): it would escape the check."""
        return [c for c in self.calls if isinstance(c.func, ast.Attribute) and c.func.attr in LEVEL_METHODS
                and _dotted(c.func.value) not in self.loggers and c.args
                and isinstance(c.args[0], ast.Constant) and _EVENT.match(str(c.args[0].value))]


def _params(fn) -> list[str]:
    a = fn.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]


def _default(fn, param: str) -> ast.AST | None:
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = dict(zip([p.arg for p in positional[len(positional) - len(a.defaults):]], a.defaults))
    defaults |= {p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None}
    return defaults.get(param)


def _literals(expr: ast.AST) -> list[str] | None:
    """The event names `expr` can evaluate to, or None if it is not made of literals."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return [expr.value]
    if isinstance(expr, ast.IfExp):
        a, b = _literals(expr.body), _literals(expr.orelse)
        return a + b if a is not None and b is not None else None
    return None


class Scanner:
    """Reads every module once; resolves helper parameters through their callers."""

    def __init__(self, sources: dict[str, str]):
        self.modules = [Module(path, text) for path, text in sources.items()]
        self.scan = Scan()

    def run(self) -> Scan:
        for m in self.modules:
            for call, levels in m.logging_calls():
                if levels is None:
                    self.scan.problems.append(f"{m.path}:{call.lineno}: {ast.unparse(call.func)}(): not a "
                                              "level method this test knows; add it to LEVEL_METHODS or "
                                              "OTHER_LOGGER_METHODS")
                else:
                    self._site(m, call, levels)
            for call in m.unknown_loggers():
                self.scan.problems.append(f"{m.path}:{call.lineno}: `{ast.unparse(call)[:120]}` looks like a log "
                                          f"call, but `{ast.unparse(call.func.value)}` is not bound to "
                                          "get_logger() in this module; bind it so, or teach this test")
        return self.scan

    def _site(self, m: Module, call: ast.Call, levels: set[str]) -> None:
        where = f"{m.path}:{call.lineno}"
        fn = m.function[id(call)]
        fields = [k.arg for k in call.keywords if k.arg is not None and k.arg != "event"]
        fields += [f for k in call.keywords if k.arg is None for f in m.spread_fields(k.value, fn)]
        expr = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "event"), None)
        key = f"{m.path}:{fn.name}" if fn is not None else m.path
        if key in DYNAMIC_EVENTS:
            names = sorted(DYNAMIC_EVENTS[key])
        else:
            names = None if expr is None else self._events(expr, fn, depth=0)
        if names is None:
            self.scan.problems.append(f"{where}: cannot tell which event `{ast.unparse(call)[:120]}` logs; "
                                      "use a literal event name, or list it in DYNAMIC_EVENTS with why")
            return
        self.scan.sites += [Site(n, where, levels, fields) for n in names]

    def _events(self, expr: ast.AST, fn, depth: int) -> list[str] | None:
        names = _literals(expr)
        if names is not None:
            return names
        if isinstance(expr, ast.Name) and fn is not None and expr.id in _params(fn) and depth < 4:
            return self._through_callers(fn, expr.id, depth)
        return None

    def _through_callers(self, fn, param: str, depth: int) -> list[str] | None:
        """Every literal passed as `param` by the callers of helper `fn` (found by name)."""
        params = _params(fn)
        index = params.index(param)
        found: list[str] = []
        for m in self.modules:
            for call in m.calls:
                if _called_name(call) != fn.name:
                    continue
                # Called as a method, `self`/`cls` is not among the positional arguments.
                method = isinstance(call.func, ast.Attribute) and params[:1] in (["self"], ["cls"])
                pos = index - 1 if method else index
                arg = next((k.value for k in call.keywords if k.arg == param), None)
                if arg is None and 0 <= pos < len(call.args):
                    arg = call.args[pos]
                if arg is None:
                    continue  # the parameter's default, if any, is read below
                names = self._events(arg, m.function[id(call)], depth + 1)
                if names is None:
                    return None
                found += names
        default = _default(fn, param)
        if default is not None:
            names = _literals(default)
            if names is None:
                return None
            found += names
        return found or None  # no caller passes a literal: nothing says what it logs


def code_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))}


# ------------------------------------------------------------------ reading LOGS.md


@dataclass
class Row:
    line: int
    level: str
    fields: str


_ROW = re.compile(r"^\|\s*`([a-z_]+(?:\.[a-z0-9_]+)+)`\s*\|")


def documented_events(text: str) -> tuple[dict[str, Row], list[str]]:
    """Rows of LOGS.md's event tables (those whose header starts `| event |`), and duplicates."""
    rows: dict[str, Row] = {}
    duplicates: list[str] = []
    in_events = False
    for n, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            in_events = False
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if cells[0] == "event":
            in_events = True
            continue
        m = _ROW.match(line)
        if in_events and m:
            if m.group(1) in rows:
                duplicates.append(f"docs/LOGS.md:{n}: `{m.group(1)}` again (first at line {rows[m.group(1)].line})")
            # event | level | when | fields (a `|` inside a cell is written `\\|`)
            rows[m.group(1)] = Row(n, cells[1], cells[3] if len(cells) > 3 else "")
    return rows, duplicates


# ------------------------------------------------------------------ the tests


@functools.cache  # one read of the code for all the tests here
def _scan() -> Scan:
    return Scanner(code_sources()).run()


def _fmt(lines: list[str]) -> str:
    return "\n  " + "\n  ".join(lines)


def test_every_logging_call_names_its_event():
    problems = _scan().problems
    assert not problems, "logging calls whose event this test cannot read:" + _fmt(problems)


def test_every_logged_event_is_documented():
    rows, _ = documented_events(DOCS.read_text())
    missing = [f"{s.event}  ({s.where})" for s in _scan().sites if s.event not in rows]
    assert not missing, "events logged but missing from docs/LOGS.md's tables:" + _fmt(missing)


def test_every_documented_event_is_logged():
    rows, duplicates = documented_events(DOCS.read_text())
    logged = {s.event for s in _scan().sites}
    dead = [f"{name}  (docs/LOGS.md:{row.line})" for name, row in rows.items() if name not in logged]
    assert not dead, "events in docs/LOGS.md that no code logs:" + _fmt(dead)
    assert not duplicates, "events documented twice:" + _fmt(duplicates)


def test_documented_level_and_fields_match_the_calls():
    rows, _ = documented_events(DOCS.read_text())
    wrong = []
    for s in _scan().sites:
        row = rows.get(s.event)
        if row is None:
            continue  # reported by test_every_logged_event_is_documented
        for level in sorted(s.levels - set(re.findall(r"[a-z]+", row.level))):
            wrong.append(f"{s.event}  ({s.where}): logged at {level}, LOGS.md:{row.line} says {row.level!r}")
        for name in s.fields:
            if f"`{name}`" not in row.fields:
                wrong.append(f"{s.event}  ({s.where}): field `{name}` not in LOGS.md:{row.line}")
    assert not wrong, "LOGS.md rows that do not match their calls:" + _fmt(wrong)


# ------------------------------------------------------------------ the scanner itself

SAMPLE = '''
import structlog
from dflash.runtime.logs import get_logger

log = get_logger()
other = object()

def plain(more):
    log.info("a.plain", x=1, y=2)
    extra = dict(u=1, **more)
    line = {"v": 2, "w": 3}
    log.info("a.spread", **extra, **line, **more)
    log.exception("a.exc")
    other.error("no such option")  # `other` is no logger, and this is no event name

def conditional(e):
    log.error("a.one" if e else "a.two", error=str(e))

def alias(quiet):
    level = log.info if quiet else log.warning
    level("a.alias", code=1)

def _say(event, n, **kw):
    log.debug(event, n=n, **kw)

class C:
    def __init__(self):
        self.log = structlog.get_logger().bind(role="x")

    def m(self, what="a.default"):
        self.log.warning(what)

    def go(self):
        _say("a.helper", 1)
        _say(event="a.keyword", n=2)
        self.m("a.method")
        self.m()

def bad(name, logger):
    log.info(f"a.{name}")
    log.info(name)
    logger.warning("a.passed_in")
'''


def test_scanner_sees_every_form_and_reports_what_it_cannot_read():
    scan = Scanner({"m.py": SAMPLE}).run()
    got = {(s.event, tuple(sorted(s.levels)), tuple(s.fields)) for s in scan.sites}
    assert got == {
        ("a.plain", ("info",), ("x", "y")), ("a.exc", ("error",), ()),
        ("a.spread", ("info",), ("u", "v", "w")),
        ("a.one", ("error",), ("error",)), ("a.two", ("error",), ("error",)),
        ("a.alias", ("info", "warning"), ("code",)),
        ("a.helper", ("debug",), ("n",)), ("a.keyword", ("debug",), ("n",)),
        ("a.method", ("warning",), ()), ("a.default", ("warning",), ()),
    }
    # The f-string, `name` of `bad` (a parameter no caller passes a literal to), and a
    # logger that came in as an argument.
    lines = SAMPLE.splitlines()
    expected = {f"m.py:{lines.index(c) + 1}" for c in ('    log.info(f"a.{name}")', "    log.info(name)",
                                                       '    logger.warning("a.passed_in")')}
    assert {p.split(": ")[0] for p in scan.problems} == expected, scan.problems


def test_dynamic_events_name_what_the_scanner_cannot(monkeypatch):
    monkeypatch.setitem(DYNAMIC_EVENTS, "m.py:bad", {"a.name_one", "a.name_two"})
    scan = Scanner({"m.py": SAMPLE}).run()
    from_bad = {s.event for s in scan.sites if s.event.startswith("a.name_")}
    assert from_bad == {"a.name_one", "a.name_two"}
    assert len(scan.problems) == 1 and "a.passed_in" in scan.problems[0], scan.problems


def test_docs_parser_reads_only_event_tables():
    text = ("| field | type |\n| --- | --- |\n| `ts` | str |\n\n"
            "| event | level | when | fields |\n| --- | --- | --- | --- |\n"
            "| `a.b` | info | when x \\| y | `f`, `g` |\n| `a.c` | warning | z | `h` |\n\n"
            "| key | fields |\n| --- | --- |\n| `run.id` | |\n"
            "| event | level | when | fields |\n| --- | --- | --- | --- |\n| `a.b` | info | again | |\n")
    rows, duplicates = documented_events(text)
    assert set(rows) == {"a.b", "a.c"} and rows["a.c"].line == 8 and rows["a.c"].fields == "`h`"
    assert duplicates == ["docs/LOGS.md:15: `a.b` again (first at line 7)"]
