"""docs/PROTOCOL.md's message tables mirror protocol/messages.py: every message type (and
each map inside one that has a type of its own there: `run_config`) has one
`| field | type |` table (a type without fields is written `type {}` instead), each
field of the dataclass is a row and each row a field, and a row's type says `optional`
exactly when the dataclass field is optional.

A table belongs to the message its intro names: the first backticked word of the last
line before it (`hello`, peer -> broker ...; ### 4.4 `batch` ...)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflash.protocol.messages import MESSAGES, RunConfig

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"
ENVELOPE_INTRO = "Header fields every message has:"
ENVELOPE = "(envelope)"
# Maps inside a message with a table of their own: name in the doc -> their type
MAPS = {"run_config": RunConfig}
TYPES = {**MESSAGES, **MAPS}


def field_tables(text: str) -> dict[str, dict[str, bool]]:
    """Message type (or ENVELOPE) -> {field: optional} of each field table in `text`."""
    lines = text.splitlines()
    out: dict[str, dict[str, bool]] = {}
    for i, line in enumerate(lines):
        if not re.match(r"^\| field \| type \|", line):
            continue
        intro = next((x.strip() for x in reversed(lines[:i]) if x.strip()), "")
        named = re.search(r"`(\w+)`", intro)
        name = ENVELOPE if intro == ENVELOPE_INTRO else named.group(1) if named else None
        assert name is not None, f"docs/PROTOCOL.md line {i + 1}: a field table whose intro {intro!r} names no message"
        assert name not in out, f"docs/PROTOCOL.md line {i + 1}: a second field table for `{name}`"
        rows: dict[str, bool] = {}
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            cells = [c.strip() for c in row.strip().strip("|").split("|")]
            names = re.findall(r"`(\w+)`", cells[0])
            assert names and len(cells) >= 2, f"docs/PROTOCOL.md: `{name}` table row {row!r} names no field"
            for n in names:
                assert n not in rows, f"docs/PROTOCOL.md: `{name}` table lists field `{n}` twice"
                rows[n] = "optional" in cells[1]
        out[name] = rows
    return out


def code_fields(cls) -> dict[str, bool]:
    return {f.name: bool(f.metadata.get("optional")) for f in cls.wire_fields()}


def mismatches(t: str, doc: dict[str, bool], code: dict[str, bool]) -> list[str]:
    """What the `t` table says against the dataclass, one sentence each."""
    cls = TYPES[t].__name__
    out = []
    for name in code:
        if name not in doc:
            what = "optional" if code[name] else "required"
            out.append(f"`{t}`: field `{name}` ({what} in protocol/messages.py {cls}) is not in the table")
    for name in doc:
        if name not in code:
            out.append(f"`{t}`: the table lists field `{name}`, which protocol/messages.py {cls} does not define")
        elif doc[name] != code[name]:
            out.append(f"`{t}`: field `{name}` is {'optional' if doc[name] else 'required'} in the table but "
                       f"{'optional' if code[name] else 'required'} in protocol/messages.py {cls}")
    return out


@pytest.fixture(scope="module")
def text() -> str:
    return DOC.read_text()


@pytest.fixture(scope="module")
def tables(text) -> dict[str, dict[str, bool]]:
    return field_tables(text)


@pytest.mark.parametrize("t", sorted(TYPES))
def test_each_message_table_mirrors_its_dataclass(t, text, tables):
    code = code_fields(TYPES[t])
    if not code:
        assert f"`{t} {{}}`" in text, f"docs/PROTOCOL.md: `{t}` has no fields; write it `{t} {{}}`"
        assert t not in tables, f"docs/PROTOCOL.md: a field table for `{t}`, which has no fields"
        return
    assert t in tables, (f"docs/PROTOCOL.md has no field table for `{t}` (fields {sorted(code)}): add one "
                         f"after a line that names `{t}` first")
    bad = mismatches(t, tables[t], code)
    assert not bad, "docs/PROTOCOL.md disagrees with protocol/messages.py:\n" + "\n".join(bad)


def test_every_table_is_of_a_message_or_the_envelope(tables):
    unknown = sorted(set(tables) - set(TYPES) - {ENVELOPE})
    assert not unknown, f"docs/PROTOCOL.md has field tables for {unknown}, which are not message types or their maps"
    assert set(tables.get(ENVELOPE, {})) == {"v", "type", "run", "tensors"}, (
        f"docs/PROTOCOL.md section 2's header table lists {sorted(tables.get(ENVELOPE, {}))}")


def test_a_disagreement_names_the_message_and_the_field():
    doc = "`lease`, producer -> broker:\n\n| field | type | |\n| --- | --- | --- |\n| `want` | int, optional | |\n"
    bad = mismatches("lease", field_tables(doc)["lease"], code_fields(MESSAGES["lease"]))
    assert bad == ["`lease`: field `want` is optional in the table but required in protocol/messages.py LeaseAsk"]
    assert mismatches("ack", {"batch_ids": False, "stepp": False}, code_fields(MESSAGES["ack"])) == [
        "`ack`: field `step` (required in protocol/messages.py Ack) is not in the table",
        "`ack`: field `lineage` (optional in protocol/messages.py Ack) is not in the table",
        "`ack`: the table lists field `stepp`, which protocol/messages.py Ack does not define"]
