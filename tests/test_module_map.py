"""docs/DESIGN.md's module map names every module of the installed folders, and only those:
a module added, removed or renamed without the map fails here. A subpackage with modules
of its own (consumers/training/ ...) is a line in its folder's section and a section of its
own (`### consumers/training/`)."""

from __future__ import annotations

import pytest
import re
from pathlib import Path

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("broker", "producers", "consumers", "decoding", "protocol", "runtime", "tools")
ENTRY = re.compile(r"^- `([\w./]+)`: \S")


def _on_disk(folder: str) -> set[str]:
    d = ROOT / folder
    names = {p.name for p in d.glob("*.py") if p.name != "__init__.py"}
    return names | {p.parent.name + "/" for p in d.glob("*/__init__.py")}


def _sections() -> list[str]:
    """The folders and every subpackage below them that holds modules besides __init__.py
    and __main__.py (producers/sample_data/ is data with a __main__, a line but no section)."""
    out = []
    for folder in FOLDERS:
        out.append(folder)
        for init in sorted((ROOT / folder).glob("**/__init__.py")):
            sub = init.parent
            if sub != ROOT / folder and any(p.name not in ("__init__.py", "__main__.py") for p in sub.glob("*.py")):
                out.append(sub.relative_to(ROOT).as_posix())
    return out


def _in_map() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text.split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    out: dict[str, list[str]] = {}
    folder = None
    for line in section.splitlines():
        head = re.match(r"^### ([\w/]+)/$", line)
        if head:
            folder = head.group(1)
            out[folder] = []
        elif line.startswith("- "):
            m = ENTRY.match(line)
            assert m and folder, f"docs/DESIGN.md module map: malformed line {line!r}"
            out[folder].append(m.group(1))
    return out


def test_every_module_is_in_the_map_and_every_entry_exists():
    listed = _in_map()
    assert sorted(listed) == sorted(_sections()), f"module map sections {sorted(listed)}, want {sorted(_sections())}"
    for folder in _sections():
        names = listed[folder]
        assert len(names) == len(set(names)), f"{folder}/ lists a module twice: {names}"
        missing = sorted(_on_disk(folder) - set(names))
        stale = sorted(set(names) - _on_disk(folder))
        assert not missing, f"docs/DESIGN.md module map lacks {folder}/{missing}: add a line for each"
        assert not stale, f"docs/DESIGN.md module map names {folder}/{stale}, which do not exist"


# `python -m dflash.<module>` as the tests, docs, benchmarks and CI spell it: a module renamed
# without them fails here, not minutes into a subprocess that exits 1 on "No module named".
RUN_AS_MODULE = re.compile(r"""-m["',\s]+(dflash(?:\.\w+)+)""")
SPELLED_IN = ("README.md", "Dockerfile", ".ci/run", "docs/*.md", "tests/**/*.py", "bench/*.py", "bench/*.sh")


def test_every_module_run_with_python_m_exists():
    import importlib.util

    missing = []
    for pattern in SPELLED_IN:
        for path in sorted(ROOT.glob(pattern)):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                for mod in RUN_AS_MODULE.findall(line):
                    if importlib.util.find_spec(mod) is None:
                        missing.append(f"{path.relative_to(ROOT)}:{n}: {mod}")
    assert not missing, "python -m of modules that do not exist:\n" + "\n".join(missing)
