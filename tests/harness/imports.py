"""The project's import graph, read from source with `ast` (nothing is imported).

The modules are those pyproject.toml maps into the `dflash` namespace (`[tool.setuptools]`
packages and package-dir). Every `import` and `from ... import` in a module counts, at any
depth: inside functions (the lazy imports that keep `--help` fast) and under
`if TYPE_CHECKING:` (a module that names another's types depends on it). Relative imports
are resolved against the importing module's package. An edge goes to the deepest project
module an import names (`from dflash.consumers.training import train` ->
dflash.consumers.training.train); imports of anything outside the project are left out
(`imported_names` keeps them, for the rules about folders outside the package: bench/, tests/).
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> its source file, for every module the installed package holds."""
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = setup["package-dir"]
    out: dict[str, Path] = {}
    for package in setup["packages"]:
        if package not in folders:
            raise ValueError(f"pyproject.toml: package {package} has no package-dir entry")
        folder = root / folders[package]
        out[package] = folder / "__init__.py"
        for path in sorted(folder.glob("*.py")):
            if path.name != "__init__.py":
                out[f"{package}.{path.stem}"] = path
    return out


@dataclass(frozen=True)
class Import:
    """One import statement's edge: `source` imports project module `target` at `line`."""

    source: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line})"


def _deepest(name: str, modules) -> str | None:
    """`name` or the nearest package above it that is a project module."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _base(module: str, is_package: bool, level: int) -> str:
    """The package a relative import of `level` dots in `module` starts from."""
    base = module if is_package else module.rpartition(".")[0]
    for _ in range(level - 1):
        base = base.rpartition(".")[0]
    return base


def imported_names(module: str, path: Path, modules) -> list[tuple[str, int]]:
    """(absolute dotted name, line) of everything `module` (source at `path`) imports,
    project or not: `from pkg import name` gives pkg.name where that is a project module,
    else pkg."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            start = _base(module, path.name == "__init__.py", node.level) if node.level else ""
            origin = ".".join(p for p in (start, node.module) if p)
            # `from pkg import name`: name is a submodule, or something defined in pkg
            names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names]
        else:
            continue
        out.extend((name, node.lineno) for name in names)
    return out


def imports_of(module: str, path: Path, modules) -> list[Import]:
    """Every project module `module` (source at `path`) imports, one Import per name imported."""
    out = []
    for name, line in imported_names(module, path, modules):
        target = _deepest(name, modules)
        if target is not None and target != module:
            out.append(Import(module, target, line))
    return out


def import_graph(root: Path = ROOT) -> dict[str, list[Import]]:
    """Project module -> the project imports it makes (each target once, at its first line)."""
    modules = project_modules(root)
    graph = {}
    for module, path in modules.items():
        first: dict[str, Import] = {}
        for edge in sorted(imports_of(module, path, modules), key=lambda e: e.line):
            first.setdefault(edge.target, edge)
        graph[module] = list(first.values())
    return graph


def cycles(graph: dict[str, list[Import]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted; a module that imports itself is left out by imports_of."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            edge = next(edges, None)
            if edge is not None:
                nxt = edge.target
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def one_cycle(graph: dict[str, list[Import]], component: list[str]) -> list[Import]:
    """A shortest loop through the first module of `component`, as its import edges: what a
    reader follows to see why the modules import each other."""
    members = set(component)
    start = component[0]
    came: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for edge in graph[node]:
                if edge.target == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, came[path[0].source])
                    return path
                if edge.target in members and edge.target not in came:
                    came[edge.target] = edge
                    nxt.append(edge.target)
        frontier = nxt
    raise AssertionError(f"{component} is not a cycle")


def defined_names(path: Path) -> tuple[set[str], set[str]]:
    """(names a module defines at its top level: def, class, assignment, also under if/try/
    with; names it imports there)."""
    defined: set[str] = set()
    imported: set[str] = set()

    def visit(body):
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(n.name)
            elif isinstance(n, ast.Assign):
                defined.update(x.id for t in n.targets for x in ast.walk(t) if isinstance(x, ast.Name))
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                defined.add(n.target.id)
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                imported.update((a.asname or a.name).split(".")[0] for a in n.names)
            elif isinstance(n, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(n, field, None) or [])
                for h in getattr(n, "handlers", None) or []:
                    visit(h.body)

    visit(ast.parse(path.read_text(), filename=str(path)).body)
    return defined, imported - defined


class Reexport(NamedTuple):
    """`where` (file:line) imports `name` from `module`, which only imports it itself."""

    where: str
    module: str
    name: str


def reexport_uses(root: Path = ROOT, files: list[Path] | None = None) -> list[Reexport]:
    """Every `from dflash.x import name` (in the package, tools, tests, bench) whose `name`
    dflash.x does not define but imports from elsewhere: an old path kept alive."""
    modules = project_modules(root)
    by_path = {p.resolve(): m for m, p in modules.items()}
    names = {m: defined_names(p) for m, p in modules.items()}
    if files is None:
        files = [p for d in ("dflash_ns", *{Path(modules[m]).relative_to(root).parts[0] for m in modules}, "tests",
                             "bench") for p in sorted((root / d).rglob("*.py"))]
    out = []
    for path in files:
        source = by_path.get(path.resolve())
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                if source is None:
                    continue
                start = _base(source, path.name == "__init__.py", node.level)
                origin = ".".join(p for p in (start, node.module) if p)
            else:
                origin = node.module or ""
            if origin not in modules:
                continue
            defined, imported = names[origin]
            for a in node.names:
                if f"{origin}.{a.name}" not in modules and a.name not in defined and a.name in imported:
                    out.append(Reexport(f"{path.relative_to(root)}:{node.lineno}", origin, a.name))
    return out
