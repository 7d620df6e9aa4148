"""bench/comment_share.py counts comment and docstring lines against all non-blank lines,
and runs on this tree, where they stay at most 15% of the package (comments say why, in a
line or two)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.bench_script import load

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "comment_share.py"


def _module():
    return load("comment_share")


def test_comment_docstring_and_code_lines_are_told_apart():
    source = '''"""A module.

Two lines of it."""

# a comment line
x = 1  # code with a comment: code


def f():
    """One line."""
    s = """not a docstring"""
    return s
'''
    c = _module().count_source(source)
    assert (c.files, c.lines, c.comments, c.docstrings) == (1, 8, 1, 3)  # blank lines count nowhere
    assert c.share == pytest.approx(4 / 8)


def test_it_runs_on_the_package():
    out = subprocess.run([sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, check=True).stdout
    doc = json.loads(out)
    assert set(doc) == {"broker", "producers", "consumers", "protocol", "runtime", "decoding", "tools", "dflash_ns",
                        "total"}
    assert doc["total"]["lines"] == sum(v["lines"] for k, v in doc.items() if k != "total") > 0
    assert 0 < doc["total"]["share"] <= 0.15, f"comments and docstrings are {doc['total']['share']:.1%} of the package"
