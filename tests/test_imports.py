"""The shape of the installed package's imports (issues 32, 37): no import cycle among the
project's modules; no import between producers/, consumers/ and broker/ (what two roles
share lives in protocol/, runtime/ or another shared folder); no package folder imports
tools/ or bench/ (the tools build on the package, never the other way); and inside
consumers/ each subpackage imports only those below it (CONSUMER_PARTS). The graph is read
from source (tests/harness/imports.py): lazy imports inside functions and TYPE_CHECKING
imports count.

There is no exception: a cycle, a cross-role import, a package module importing a tool or a
consumers part importing one above it fails, naming the imports that make it. Nor does a
name come from a module that only imports it (a re-export keeping an old path alive):
everyone imports it from where it is defined."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.harness.imports import (Import, cycles, import_graph, imported_names, one_cycle, project_modules,
                                   reexport_uses)

pytestmark = pytest.mark.unit

ROLES = ("dflash.producers", "dflash.consumers", "dflash.broker")
# The installed folders the roles run on, and what they must not import: the tools
# (dflash-eval, -status, ...) and the benchmarks and tests, which import them.
PACKAGE = (*ROLES, "dflash.protocol", "dflash.runtime", "dflash.decoding")
ABOVE_THE_PACKAGE = ("dflash.tools", "bench", "tests")
# consumers/ by concern: what each subpackage may import of the others (process/, the
# process that runs them all, may import every part; drafter/, checkpoints/ and parallel/
# none). The consumers/__init__.py docstring and docs/DESIGN.md's module map give the order.
CONSUMER_PARTS: dict[str, frozenset[str]] = {
    "drafter": frozenset(),
    "checkpoints": frozenset(),
    "parallel": frozenset(),
    "training": frozenset({"drafter", "checkpoints", "parallel"}),
    "export": frozenset({"drafter", "checkpoints"}),
    "evaluation": frozenset({"drafter", "checkpoints", "training", "export"}),
    "process": frozenset({"drafter", "checkpoints", "parallel", "training", "export", "evaluation"}),
}


def _role(module: str) -> str | None:
    return next((r for r in ROLES if module == r or module.startswith(r + ".")), None)

# Re-exports not yet removed: module -> why. broker/config.py's are imported by
# broker/server.py and broker/broker_command.py, which the broker split and the options
# work are rewriting now (issue 37 leaves them to those branches).
def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _consumer_part(module: str) -> str | None:
    """`training` for dflash.consumers.training.train; "" for dflash.consumers itself;
    None outside consumers/."""
    if module == "dflash.consumers":
        return ""
    return module.split(".")[2] if module.startswith("dflash.consumers.") else None


def _loop(graph, component) -> str:
    return "\n    ".join(str(e) for e in one_cycle(graph, component))


@pytest.fixture(scope="module")
def graph() -> dict[str, list[Import]]:
    return import_graph()


def test_the_graph_is_the_installed_packages():
    """The folders pyproject maps are the ones Python imports `dflash.*` from (the editable
    install of this tree), so the graph is the installed package's."""
    modules = project_modules()
    packages = [m for m, p in modules.items() if p.name == "__init__.py"]
    assert "dflash.broker.core" in modules and len(packages) >= 7
    for package in packages:
        spec = importlib.util.find_spec(package)
        assert spec is not None, f"{package} is not installed"
        where = [Path(p).resolve() for p in spec.submodule_search_locations]
        assert modules[package].parent.resolve() in where, f"{package} is imported from {where}, not this tree"


def test_no_import_cycle(graph):
    found = cycles(graph)
    assert not found, "import cycles among the project's modules (each with one loop through it):\n" + "\n".join(
        f"  {', '.join(c)}\n    {_loop(graph, c)}" for c in found)


def test_no_import_between_roles(graph):
    crossing = [e for edges in graph.values() for e in edges
                if _role(e.source) and _role(e.target) and _role(e.source) != _role(e.target)]
    for e in crossing:
        print(f"role import: {e}")
    assert not crossing, ("imports between producers/, consumers/ and broker/ (move what two roles share to "
                          "protocol/, runtime/ or decoding/):\n" + "\n".join(f"  {e}" for e in crossing))


def test_no_package_folder_imports_tools_or_bench():
    modules = project_modules()
    found = sorted({f"{module} -> {name} (line {line})" for module, path in modules.items() if _under(module, PACKAGE)
                    for name, line in imported_names(module, path, modules) if _under(name, ABOVE_THE_PACKAGE)})
    assert not found, ("package modules importing tools/, bench/ or tests/ (move what they need into the package, "
                       "e.g. consumers/evaluation/ for dflash-eval's core):\n" + "\n".join(f"  {f}" for f in found))


def test_every_consumers_module_is_in_a_known_part(graph):
    stray = sorted(m for m in graph if _consumer_part(m) not in (None, "", *CONSUMER_PARTS))
    assert not stray, (f"consumers/ modules outside its parts {sorted(CONSUMER_PARTS)} (put each in the part that "
                       f"owns its concern, or add a part to CONSUMER_PARTS): {stray}")


def test_consumers_parts_import_in_layer_order(graph):
    wrong = []
    for edges in graph.values():
        for e in edges:
            src, dst = _consumer_part(e.source), _consumer_part(e.target)
            if src is None or dst is None or src == dst:
                continue
            if dst not in CONSUMER_PARTS.get(src, frozenset()):
                wrong.append(e)
    assert not wrong, ("consumers/ parts importing a part they may not (CONSUMER_PARTS: drafter/ imports nothing of "
                       "training/ or process/, process/ may import all):\n" + "\n".join(f"  {e}" for e in wrong))


def test_no_name_is_imported_through_a_module_that_only_imports_it():
    found = reexport_uses()
    assert not found, ("names imported from a module that only re-exports them (import each from the module that "
                       "defines it, and drop the re-export):\n" + "\n".join(f"  {r}" for r in found))


def test_a_reexport_is_found(tmp_path):
    root = _tree(tmp_path, {"a/x.py": "def f():\n    pass\n", "a/y.py": "from .x import f\nfrom . import x\n",
                            "b/w.py": "from p.a.y import f\nfrom p.a.y import x\nfrom p.a.x import f as g\n"})
    found = reexport_uses(root, [root / "b" / "w.py"])
    assert [(r.where, r.module, r.name) for r in found] == [("b/w.py:1", "p.a.y", "f"), ("b/w.py:2", "p.a.y", "x")]


def test_the_layer_rule_catches_an_import_upwards():
    e = Import("dflash.consumers.drafter.model", "dflash.consumers.training.train", 3)
    assert "training" not in CONSUMER_PARTS[_consumer_part(e.source)]
    assert _consumer_part("dflash.consumers.train") == "train" not in CONSUMER_PARTS  # a flat module: no part
    assert _under("dflash.tools.eval", ABOVE_THE_PACKAGE) and not _under("dflash.toolsx", ABOVE_THE_PACKAGE)


# ---------------------------------------------------------------- the walker on a tree made here


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = ["p", "p.a", "p.b"]\n'
        '[tool.setuptools.package-dir]\n"p" = "ns"\n"p.a" = "a"\n"p.b" = "b"\n')
    for name, text in {"ns/__init__.py": "", "a/__init__.py": "", "b/__init__.py": "", **files}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_walker_follows_every_kind_of_import(tmp_path):
    root = _tree(tmp_path, {
        "a/x.py": "from . import y\nfrom .z import thing\nimport os\n",
        "a/y.py": "def f():\n    from p.b.w import g\n",
        "a/z.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..b import w\nthing = 1\n",
        "b/w.py": "import p.a.x\nfrom p.a import nothing_here\n",
    })
    graph = import_graph(root)
    edges = {(e.source, e.target) for es in graph.values() for e in es}
    assert edges == {("p.a.x", "p.a.y"), ("p.a.x", "p.a.z"), ("p.a.y", "p.b.w"), ("p.a.z", "p.b.w"),
                     ("p.b.w", "p.a.x"), ("p.b.w", "p.a")}
    assert cycles(graph) == [["p.a.x", "p.a.y", "p.a.z", "p.b.w"]]
    loop = one_cycle(graph, ["p.a.x", "p.a.y", "p.a.z", "p.b.w"])
    assert [e.source for e in loop] == ["p.a.x", "p.a.y", "p.b.w"] and loop[-1].target == "p.a.x"


def test_a_tree_without_loops_has_no_cycle(tmp_path):
    root = _tree(tmp_path, {"a/x.py": "from . import y\n", "a/y.py": "from p.b import w\n", "b/w.py": "x = 1\n"})
    assert cycles(import_graph(root)) == []
