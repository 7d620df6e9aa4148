"""Dataset reading: every row format, random access by sample ID through the cached line
index, malformed rows named by file:line, and a path-independent fingerprint."""

from __future__ import annotations

import shutil

import pytest
from tests.producers.helpers import chat, write_jsonl

from dflash.producers.data import BadRow, JsonlSource, build_line_index, open_dataset
from dflash.protocol.errors import DFlashError

pytestmark = pytest.mark.unit


def test_formats_parse_to_the_same_turns(tmp_path):
    rows = [
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                      {"role": "assistant", "content": "A"}]},
        {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                           {"from": "gpt", "value": "A"}]},
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "Q"}]},
                      {"role": "assistant", "content": "A"}]},
        {"text": "plain continuation text"},
    ]
    ds = open_dataset(write_jsonl(tmp_path / "d.jsonl", rows))
    assert len(ds) == 4
    assert ds.read(0).messages == ds.read(1).messages == ds.read(2).messages
    assert ds.read(0).messages[1] == {"role": "user", "content": "Q"}
    r = ds.read(3)
    assert r.text == "plain continuation text" and r.messages is None


def test_random_access_uses_line_offsets_and_skips_empty_lines(tmp_path):
    p = tmp_path / "d.jsonl"
    lines = []
    for i in range(2000):
        lines.append(f'{{"text": "row {i}"}}')
        if i % 500 == 0:
            lines.append("")  # blank separators are not rows
    p.write_text("\n".join(lines))  # and no newline after the last row
    ds = open_dataset(p)
    assert len(ds) == 2000
    for i in (1999, 0, 1234, 501):
        row = ds.read(i)
        assert row.text == f"row {i}"
    # Line numbers count the blank lines (after rows 0 and 500): row 501 is on line 504.
    assert ds.read(501).source == f"{p}:504"
    with pytest.raises(IndexError):
        ds.read(2000)


def test_line_index_is_built_once_and_cached(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(i) for i in range(50)])
    first = JsonlSource(path)
    second = JsonlSource(path)
    assert not first.index_cached and second.index_cached
    assert second.read(49).messages == first.read(49).messages
    # A changed file is re-indexed, not read through a stale index.
    write_jsonl(tmp_path / "d.jsonl", [chat(i) for i in range(60)])
    third = JsonlSource(path)
    assert not third.index_cached and len(third) == 60


def test_build_line_index_handles_chunk_boundaries(tmp_path, monkeypatch):
    import dflash.producers.data as data

    monkeypatch.setattr(data, "_CHUNK", 7)  # newlines fall on and around chunk edges
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"a":1}\n\n{"b":22}\n{"c":333}')
    starts, lengths, line_nos = build_line_index(p)
    raw = p.read_bytes()
    assert [raw[s:s + n] for s, n in zip(starts, lengths)] == [b'{"a":1}', b'{"b":22}', b'{"c":333}']
    assert line_nos.tolist() == [1, 3, 4]


@pytest.mark.parametrize("line,reason", [
    ('{"messages": [{"role": "user", "content": "hi"}', "invalid JSON"),
    ('["not", "an", "object"]', "not an object"),
    ('{"prompt": "x"}', "no 'messages', 'conversations' or 'text'"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "unknown role 'wizard'"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "only a system turn last"}]}', "no assistant turn"),
    ('{"conversations": [{"from": "human"}, {"from": "gpt", "value": "a"}]}', "no 'value'/'content'"),
    ('{"messages": [{"role": "assistant", "content": 42}]}', "content is a int"),
    ('{"text": ""}', "'text' is empty"),
])
def test_bad_rows_name_file_line_and_reason(tmp_path, line, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [chat(0), chat(1)], raw_lines=[line])
    ds = open_dataset(path)
    with pytest.raises(BadRow) as e:
        ds.read(2)
    assert str(e.value).startswith(f"{path}:3: ")
    assert reason in str(e.value)
    assert e.value.sample == 2


def test_fingerprint_is_content_not_path(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(30)])
    (tmp_path / "copy").mkdir()
    b = shutil.copy(a, tmp_path / "copy" / "b.jsonl")
    c = write_jsonl(tmp_path / "c.jsonl", [chat(i) for i in range(29)] + [chat(99)])
    fa, fb, fc = (open_dataset(p).fingerprint for p in (a, b, c))
    assert fa == fb
    assert fa != fc


def test_unknown_format_and_missing_file(tmp_path):
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DFlashError, match="unknown format"):
        open_dataset(tmp_path / "d.csv")
    with pytest.raises(FileNotFoundError):
        open_dataset(tmp_path / "nope.jsonl")


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [chat(i) for i in range(20)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet", row_group_size=6)
    ds = open_dataset(tmp_path / "d.parquet")
    assert len(ds) == 20 and ds.read(13).messages == chat(13)["messages"]
    assert ds.read(13).source.endswith("[row 13]")


def test_hf_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [chat(i) for i in range(20)]
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "ds")
    ds = open_dataset(tmp_path / "ds")
    assert len(ds) == 20 and ds.read(7).messages == chat(7)["messages"]
    assert ds.fingerprint == open_dataset(tmp_path / "ds").fingerprint
