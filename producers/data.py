"""Datasets read by sample ID: JSON Lines, a local Hugging Face `datasets` folder, parquet.

The broker leases rows in shuffled order, so every source is random access (JSON Lines through
a cached line-offset index: one `pread` per row). `fingerprint` hashes content, not the path,
so the broker can check that every producer on any host reads the same data."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from dflash.protocol.errors import DFlashError
from dflash.runtime.logs import get_logger

log = get_logger()

ROLE_ALIASES = {
    "system": "system", "user": "user", "human": "user", "assistant": "assistant",
    "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant", "tool": "tool",
}
_CHUNK = 16 << 20
_INDEX_VERSION = 1


class BadRow(DFlashError):
    """A dataset row that cannot be used. `source` is `file:line` (or `dir[row N]`)."""

    def __init__(self, sample: int, source: str, reason: str):
        self.sample, self.source, self.reason = sample, source, reason
        super().__init__(f"{source}: {reason}")


@dataclass
class Row:
    """One parsed sample: `messages` or `text`; a regenerated chat also carries its exact IDs and mask."""

    sample: int
    source: str
    messages: list[dict] | None = None  # may end in a user turn with no answer: `--regenerate` writes it
    text: str | None = None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    endings: tuple[str, ...] | None = None  # regenerated: how each answer ended (decoding/endings.py)


class DataSource(Protocol):
    path: str
    fingerprint: str

    def __len__(self) -> int: ...

    def read(self, sample: int) -> Row: ...


# ---------------------------------------------------------------- record -> Row


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    # OpenAI-style content parts: text parts are joined; anything else (images) is refused.
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    raise ValueError(f"{where}: content is a {type(value).__name__}, expected a string")


def _turns(turns: Any, field: str) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"'{field}' must be a non-empty list of turns")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise ValueError(f"{field}[{i}] is a {type(t).__name__}, not an object")
        role = t.get("from", t.get("role"))  # ShareGPT from/value or role/content
        if role not in ROLE_ALIASES:
            raise ValueError(f"{field}[{i}]: unknown role {role!r}")
        value = t.get("value", t.get("content"))
        if value is None:
            raise ValueError(f"{field}[{i}]: no 'value'/'content'")
        out.append({"role": ROLE_ALIASES[role], "content": _content(value, f"{field}[{i}]")})
    if not any(m["role"] == "assistant" for m in out) and out[-1]["role"] != "user":
        raise ValueError(f"'{field}' has no assistant turn: nothing to learn from")
    return out


def parse_record(obj: Any, sample: int, source: str) -> Row:
    """A decoded record -> Row. Raises BadRow naming `source` and the reason."""
    try:
        if not isinstance(obj, dict):
            raise ValueError(f"row is a JSON {type(obj).__name__}, not an object")
        for field in ("messages", "conversations"):
            if obj.get(field) is not None:
                return Row(sample, source, messages=_turns(obj[field], field))
        if obj.get("text") is not None:
            if not isinstance(obj["text"], str) or not obj["text"].strip():
                raise ValueError("'text' is empty or not a string")
            return Row(sample, source, text=obj["text"])
        raise ValueError(f"no 'messages', 'conversations' or 'text' field (keys: {sorted(obj)[:8]})")
    except ValueError as e:
        raise BadRow(sample, source, str(e)) from None


# ---------------------------------------------------------------- fingerprint


def file_fingerprint(path: str | os.PathLike, n_rows: int, windows: int = 64, size: int = 4096) -> str:
    """Hash of the row count, the file size and `windows` evenly spaced byte windows."""
    h = hashlib.sha256(f"{n_rows}:{os.path.getsize(path)}".encode())
    total = os.path.getsize(path)
    with open(path, "rb") as f:
        for k in range(windows):
            f.seek(total * k // windows)
            h.update(f.read(size))
        f.seek(max(0, total - size))
        h.update(f.read(size))
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- JSON Lines


def build_line_index(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, lengths, line numbers) of the non-empty lines, in file order."""
    newlines = []
    with open(path, "rb") as f:
        base = 0
        while chunk := f.read(_CHUNK):
            newlines.append(np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10) + base)
            base += len(chunk)
    nl = np.concatenate(newlines) if newlines else np.zeros(0, np.int64)
    starts = np.concatenate([[0], nl + 1]).astype(np.int64)
    ends = np.concatenate([nl, [base]]).astype(np.int64)  # last line may lack a newline
    line_nos = np.arange(1, len(starts) + 1, dtype=np.int64)
    keep = ends > starts  # empty lines are not rows (a trailing newline, blank separators)
    return starts[keep], (ends - starts)[keep], line_nos[keep]


def _cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_CACHE") or Path.home() / ".cache" / "dflash")


class JsonlSource:
    """Random access to the rows of a JSON Lines file through a cached line index."""

    def __init__(self, path: str | os.PathLike, cache_dir: str | os.PathLike | None = None):
        self.path = str(path)
        st = os.stat(self.path)
        key = hashlib.sha256(f"{_INDEX_VERSION}:{os.path.abspath(self.path)}:{st.st_size}:{st.st_mtime_ns}"
                             .encode()).hexdigest()[:20]
        idx_path = Path(cache_dir or _cache_dir() / "index") / f"{key}.npz"
        t0 = time.monotonic()
        self.index_cached = idx_path.exists()
        if self.index_cached:
            z = np.load(idx_path)
            self.starts, self.lengths, self.line_nos = z["starts"], z["lengths"], z["line_nos"]
            self.fingerprint = str(z["fingerprint"])
        else:
            self.starts, self.lengths, self.line_nos = build_line_index(self.path)
            self.fingerprint = file_fingerprint(self.path, len(self.starts))
            _save_npz(idx_path, starts=self.starts, lengths=self.lengths, line_nos=self.line_nos,
                      fingerprint=np.array(self.fingerprint))
        self._fd = os.open(self.path, os.O_RDONLY)
        log.info("produce.data_opened", path=self.path, format="jsonl", rows=len(self),
                 fingerprint=self.fingerprint, index_cached=self.index_cached, index_s=round(time.monotonic() - t0, 3))

    def __len__(self) -> int:
        return len(self.starts)

    def read(self, sample: int) -> Row:
        """Row `sample`. Raises IndexError (no such row), BadRow (malformed)."""
        if not 0 <= sample < len(self):
            raise IndexError(f"sample {sample} out of range: {self.path} has {len(self)} rows")
        # pread: thread-safe, no shared file position between the prefetch thread and others.
        raw = os.pread(self._fd, int(self.lengths[sample]), int(self.starts[sample]))
        source = f"{self.path}:{int(self.line_nos[sample])}"
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRow(sample, source, f"invalid JSON: {e}") from None
        return parse_record(obj, sample, source)

    def close(self) -> None:
        os.close(self._fd)


def _save_npz(path: Path, **arrays) -> None:
    """Write atomically: a reader never sees half an index (several producers per host)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


# ---------------------------------------------------------------- datasets / parquet


class ArrowSource:
    """A local HF `datasets` folder or a parquet file by row index; parquet is read into one Arrow
    table, else row groups would be decompressed once per sample in shuffled order."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        if Path(self.path).is_dir():
            if importlib.util.find_spec("datasets") is None:
                raise DFlashError(f"{self.path} is a folder: reading a HF datasets folder needs "
                                  "the 'datasets' package (pip install datasets)")
            import datasets

            ds = datasets.load_from_disk(self.path)
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise DFlashError(f"{self.path} holds splits {list(ds)}; none is 'train'")
                ds = ds["train"]
            self._rows = ds
            self.fingerprint = hashlib.sha256(f"{len(ds)}:{ds._fingerprint}".encode()).hexdigest()[:16]
            self.format = "hf_datasets"
        else:
            if importlib.util.find_spec("pyarrow") is None:
                raise DFlashError(f"{self.path}: reading parquet needs the 'pyarrow' package")
            import pyarrow.parquet as pq

            self._rows = pq.read_table(self.path)
            self.fingerprint = file_fingerprint(self.path, self._rows.num_rows)
            self.format = "parquet"
        log.info("produce.data_opened", path=self.path, format=self.format, rows=len(self),
                 fingerprint=self.fingerprint, index_cached=None, index_s=0.0)

    def __len__(self) -> int:
        return self._rows.num_rows

    def read(self, sample: int) -> Row:
        if not 0 <= sample < len(self):
            raise IndexError(f"sample {sample} out of range: {self.path} has {len(self)} rows")
        if self.format == "parquet":  # a pyarrow.Table
            obj = self._rows.slice(sample, 1).to_pylist()[0]
        else:
            obj = self._rows[sample]
        return parse_record(obj, sample, f"{self.path}[row {sample}]")


def open_dataset(path: str | os.PathLike) -> DataSource:
    """JSONL, parquet or a HF datasets folder. Raises FileNotFoundError, DFlashError."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"dataset {path} does not exist")
    if p.is_dir() or p.suffix == ".parquet":
        return ArrowSource(p)
    if p.suffix in (".jsonl", ".json", ".ndjson"):
        return JsonlSource(p)
    raise DFlashError(f"dataset {path}: unknown format (expected .jsonl, .parquet or a datasets folder)")
