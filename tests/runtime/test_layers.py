"""The layering of docs/DESIGN.md's module map: protocol/ (the wire) and runtime/ (process
plumbing) import no role, and runtime/ nothing of protocol/, so any folder may use either
and runtime/ never pulls in the wire."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("dflash.broker", "dflash.producers", "dflash.consumers", "dflash.tools")


def _imports(folder: str) -> dict[str, set[str]]:
    """Every absolute module each file of `folder` imports, at any depth of its code."""
    out = {}
    for path in sorted((ROOT / folder).glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        out[f"{folder}/{path.name}"] = names
    return out


def _under(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


@pytest.mark.parametrize("folder", ["protocol", "runtime"])
def test_no_role_is_imported(folder):
    bad = {f: sorted(n for n in names if _under(n, ROLES)) for f, names in _imports(folder).items()}
    assert not {f: n for f, n in bad.items() if n}, f"{folder}/ imports a role"


def test_runtime_does_not_import_the_wire():
    bad = {f: sorted(n for n in names if _under(n, ("dflash.protocol",))) for f, names in _imports("runtime").items()}
    assert not {f: n for f, n in bad.items() if n}, "runtime/ imports protocol/"
