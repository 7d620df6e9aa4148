"""The layering of docs/DESIGN.md's module map: protocol/ (the wire) and runtime/ (process
plumbing) import no role, and runtime/ nothing of protocol/, so any folder may use either
and runtime/ never pulls in the wire. The imports are read as tests/test_imports.py reads
them (tests/harness/imports.py: at any depth of the code)."""

from __future__ import annotations

import pytest

from tests.harness.imports import import_graph

pytestmark = pytest.mark.unit

ROLES = ("dflash.broker", "dflash.producers", "dflash.consumers", "dflash.tools")


def _under(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _imports_into(folder: str, packages) -> list[str]:
    """`folder`'s imports of a module under `packages`, one line each."""
    graph = import_graph()
    return [str(e) for module, edges in graph.items() if _under(module, (f"dflash.{folder}",))
            for e in edges if _under(e.target, packages)]


@pytest.mark.parametrize("folder", ["protocol", "runtime"])
def test_no_role_is_imported(folder):
    bad = _imports_into(folder, ROLES)
    assert not bad, f"{folder}/ imports a role:\n" + "\n".join(bad)


def test_runtime_does_not_import_the_wire():
    bad = _imports_into("runtime", ("dflash.protocol",))
    assert not bad, "runtime/ imports protocol/:\n" + "\n".join(bad)
