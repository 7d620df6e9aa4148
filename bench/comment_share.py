"""Comment lines as a share of the package's lines, per folder and in total.

    python bench/comment_share.py [--json]

A line counts when it is not blank. A comment line holds only a `#` comment (a comment
after code on the same line is code); a docstring line is a line of a module's, class's
or function's docstring. Their share of all non-blank lines is what the style notes
compare with other trainers (10-14% there). The package is the installed folders:
broker, producers, consumers, protocol, runtime, decoding, tools and dflash_ns.
"""

from __future__ import annotations

import ast
import io
import json
import sys
import tokenize
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("broker", "producers", "consumers", "protocol", "runtime", "decoding", "tools", "dflash_ns")


@dataclass
class Count:
    files: int = 0
    lines: int = 0  # non-blank
    comments: int = 0  # lines that are only a `#` comment
    docstrings: int = 0  # lines of docstrings

    def add(self, other: "Count") -> None:
        self.files += other.files
        self.lines += other.lines
        self.comments += other.comments
        self.docstrings += other.docstrings

    @property
    def share(self) -> float:
        return (self.comments + self.docstrings) / self.lines if self.lines else 0.0


def count_source(text: str) -> Count:
    """One file's counts."""
    lines = text.splitlines()
    nonblank = {n for n, line in enumerate(lines, 1) if line.strip()}
    comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].lstrip().startswith("#")}
    docs: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docs.update(range(first.lineno, first.end_lineno + 1))
    return Count(1, len(nonblank), len(comments & nonblank), len((docs - comments) & nonblank))


def count_folder(folder: Path) -> Count:
    total = Count()
    for path in sorted(folder.rglob("*.py")):
        total.add(count_source(path.read_text()))
    return total


def main(argv: list[str]) -> None:
    counts = {name: count_folder(ROOT / name) for name in FOLDERS}
    total = Count()
    for c in counts.values():
        total.add(c)
    if "--json" in argv:
        print(json.dumps({**{k: {**asdict(c), "share": round(c.share, 4)} for k, c in counts.items()},
                          "total": {**asdict(total), "share": round(total.share, 4)}}))
        return
    print(f"{'folder':<10} {'files':>5} {'lines':>7} {'comment':>8} {'docstring':>9} {'share':>6}")
    for name, c in [*counts.items(), ("total", total)]:
        print(f"{name:<10} {c.files:>5} {c.lines:>7} {c.comments:>8} {c.docstrings:>9} {100 * c.share:>5.1f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
