"""The layering of docs/DESIGN.md's module map: protocol/ (the wire), runtime/ (process
plumbing) and decoding/ (the greedy decoding core) import no role, and runtime/ and decoding/
nothing of protocol/, so any folder may use them and they never pull in the wire. The imports are read as tests/test_imports.py reads
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


@pytest.mark.parametrize("folder", ["protocol", "runtime", "decoding"])
def test_no_role_is_imported(folder):
    bad = _imports_into(folder, ROLES)
    assert not bad, f"{folder}/ imports a role:\n" + "\n".join(bad)


@pytest.mark.parametrize("folder", ["runtime", "decoding"])
def test_plumbing_does_not_import_the_wire(folder):
    bad = _imports_into(folder, ("dflash.protocol",))
    assert not bad, f"{folder}/ imports protocol/:\n" + "\n".join(bad)
