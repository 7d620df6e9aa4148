"""The shape of the broker's core (issue 32): the server reaches the core only through its
typed entry points and the few readings its loop needs; the core's modules read no clock
(`now` is passed in), import no ZeroMQ, and never the server. Read from source."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from dflash.broker import core as core_module
from dflash.broker.core import BrokerCore
from tests.harness.imports import import_graph

pytestmark = pytest.mark.unit

BROKER = Path(core_module.__file__).parent
# The ledger is the core's store, not its policy: its flush clock is injected, and its rows
# are stamped with the wall clock when they are written.
STORES = {"dflash.broker.ledger"}


def core_modules() -> list[str]:
    """Every dflash.broker module the core imports, directly or through another."""
    graph = import_graph()
    seen, todo = set(), ["dflash.broker.core"]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += [e.target for e in graph.get(m, []) if e.target.startswith("dflash.broker.")]
    return sorted(seen)


def test_the_core_is_its_parts():
    mods = core_modules()
    for part in ("sessions", "work", "intake", "delivery", "commits", "facts", "status", "phase", "replies"):
        assert f"dflash.broker.{part}" in mods
    assert "dflash.broker.server" not in mods and "dflash.broker.broker_process" not in mods


def _clock_reads(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "time":
            out.append(f"{path.name}:{node.lineno}: time.{node.attr}")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names]
            if (isinstance(node, ast.Import) and ("time" in names or "zmq" in names)) or \
                    (isinstance(node, ast.ImportFrom) and node.module in ("time", "zmq")):
                out.append(f"{path.name}:{node.lineno}: imports {names if isinstance(node, ast.Import) else node.module}")
    return out


def test_no_module_of_the_core_reads_a_clock_or_imports_zmq():
    found = []
    for m in core_modules():
        if m in STORES:
            continue
        found += _clock_reads(Path(importlib.import_module(m).__file__))
    assert not found, "the core's modules take `now` from the server; found:\n  " + "\n  ".join(found)


def test_the_scan_sees_a_clock_where_there_is_one(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import time\n\ndef f():\n    return time.monotonic()\n")
    assert [x.split(": ", 1)[1] for x in _clock_reads(p)] == ["imports ['time']", "time.monotonic"]


def core_api() -> set[str]:
    """BrokerCore's public names: its entry points and the readings the server's loop needs."""
    names = {n for n, _ in inspect.getmembers(BrokerCore) if not n.startswith("_")}
    return names | {"run_id", "run_dir", "endpoints"}  # set in __init__


def test_the_server_reaches_the_core_only_through_its_entry_points():
    tree = ast.parse((BROKER / "server.py").read_text())
    used = {}
    for node in ast.walk(tree):
        # self.core.X and core.X (the loop's local alias)
        if isinstance(node, ast.Attribute):
            v = node.value
            if (isinstance(v, ast.Attribute) and v.attr == "core" and isinstance(v.value, ast.Name)
                    and v.value.id == "self") or (isinstance(v, ast.Name) and v.id == "core"):
                used.setdefault(node.attr, node.lineno)
    api = core_api()
    beyond = {name: line for name, line in used.items() if name not in api}
    assert not beyond, f"server.py reaches into the core past its entry points: {beyond}"
    entries = {n for n in used if n.startswith("on_")}
    assert entries >= {"on_hello", "on_status", "on_lease", "on_done", "on_credit", "on_ack", "on_commit",
                       "on_lineage", "on_heartbeat", "on_bye", "on_failed", "on_unreadable", "on_batch",
                       "on_bad_batch"}, sorted(entries)
    # the parts are the core's own: none of them is part of what the server may call
    assert not api & {"sessions", "work", "intake", "delivery", "commits", "facts", "life", "status", "ledger"}


def test_every_message_to_the_broker_has_one_entry_point():
    from dflash.broker.inbound import TO_BROKER

    src = (BROKER / "server.py").read_text()
    for t, cls in TO_BROKER.items():
        assert f"case {cls.__name__}():" in src, f"server.py routes no {t!r} ({cls.__name__}) to the core"
