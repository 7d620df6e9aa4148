"""Every role's one way to a target model (config, tokenizer, whole model, default layers), whatever
`--target` names: a HF folder or hub ID, or a `.gguf` file (the `gguf` extra).

GGUF de-quantisation runs in Python and is slow, so the first whole load converts the file to a
plain folder in the wanted dtype, cached by its SHA-256 (`$DFLASH_GGUF_CACHE`; `off` disables it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from .load_progress import load_bars
from .logs import get_logger
from .progress import progress, ticking

log = get_logger()

GGUF_SUFFIX = ".gguf"

# GGUF names of the two vocabulary tensors (a tied model has no `output.weight`).
GGUF_EMBED = "token_embd.weight"
GGUF_HEAD = "output.weight"


def gguf_path(target: str | Path) -> Path | None:
    """The file if `target` names a .gguf file, else None; FileNotFoundError if it is not a file."""
    p = Path(target)
    if p.suffix.lower() != GGUF_SUFFIX:
        return None
    if not p.is_file():
        raise FileNotFoundError(f"--target {target}: no such GGUF file")
    return p


def describe(target: str | Path) -> str:
    """How a target is named in logs: 'gguf' or 'folder' (hub IDs count as folders)."""
    return "gguf" if gguf_path(target) is not None else "folder"


def _args(target: str | Path) -> tuple[str, dict]:
    """(name for from_pretrained, extra keyword arguments): GGUF goes as folder + file name."""
    g = gguf_path(target)
    if g is None:
        return str(target), {}
    return str(g.parent), {"gguf_file": g.name}


def reading(target: str | Path):
    """Elapsed time shown while a .gguf file's metadata is read (slow Python); nothing for a folder."""
    g = gguf_path(target)
    return ticking(f"read {g.name}", end_line=False) if g is not None else nullcontext()


def load_config(target: str | Path, *, trust_remote_code: bool = False):
    """The target's transformers config (from config.json, or the GGUF file's metadata: from its
    converted folder when one exists, since parsing the metadata takes seconds in every process)."""
    from transformers import AutoConfig

    name, kw = _read_from(target)
    with reading(name if not kw else target):
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, **kw)


def load_tokenizer(target: str | Path, *, trust_remote_code: bool = False):
    """The target's tokenizer (its folder's files, or the one a GGUF file embeds: from its converted
    folder when one exists, which holds that very tokenizer)."""
    from transformers import AutoTokenizer

    name, kw = _read_from(target)
    with reading(name if not kw else target):
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **kw)


def _read_from(target: str | Path) -> tuple[str, dict]:
    """`_args(target)`, or a GGUF file's converted folder if there is one already (none is made)."""
    g = gguf_path(target)
    folder = converted_folder(g) if g is not None else None
    return (str(folder), {}) if folder is not None else _args(target)


def load_causal_lm(target: str | Path, **kw: Any):
    """`AutoModelForCausalLM.from_pretrained` of the target; a GGUF file with a dtype loads from its cached folder."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its own bars would land among the JSON log lines: ours instead
    name, extra = _args(target)
    g = gguf_path(target)
    if g is not None and isinstance(kw.get("dtype"), torch.dtype) and (folder := cached_gguf_folder(g, kw["dtype"])):
        name, extra = str(folder), {}
    with load_bars(f"load {Path(str(target)).name}", gguf_file="gguf_file" in extra):
        return AutoModelForCausalLM.from_pretrained(name, **extra, **kw)


GGUF_CACHE_ENV = "DFLASH_GGUF_CACHE"
CONVERT_VERSION = 2  # bump when the conversion changes: a stale folder is rebuilt


def gguf_cache_root() -> Path | None:
    """Where converted GGUF folders are kept, or None when the cache is off."""
    value = os.environ.get(GGUF_CACHE_ENV, "")
    if value.lower() in ("off", "0", "false", "no"):
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "dflash" / "gguf"


HASH_PROGRESS_BYTES = 1 << 30  # a file this large takes seconds to hash: its progress is shown


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    size = os.path.getsize(path)
    shown = size >= HASH_PROGRESS_BYTES
    with open(path, "rb") as f, (progress(f"hash {Path(path).name}", size >> 20, "MiB") if shown
                                 else nullcontext()) as bar:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
            if shown:
                bar.update(len(chunk) >> 20)
    return h.hexdigest()


def cached_gguf_folder(gguf: Path, dtype: torch.dtype) -> Path | None:
    """The converted folder of `gguf` in `dtype` (made if missing), or None when the cache is off or unwritable."""
    root = gguf_cache_root()
    if root is None:
        return None
    sha, name = gguf_sha256(gguf), str(dtype).removeprefix("torch.")
    dest, stamp = _converted(root, sha, name)
    try:
        cached = is_converted(dest, stamp)
        t0 = time.monotonic()
        convert_gguf(gguf, dest, dtype, stamp)
    except OSError as e:  # a read-only or full disk: slower, not wrong
        log.warning("target.gguf_cache_unwritable", gguf=str(gguf), folder=str(dest), error=str(e)[:300])
        return None
    log.info("target.gguf_folder", gguf=str(gguf), folder=str(dest), dtype=name, cached=cached,
             convert_s=0.0 if cached else round(time.monotonic() - t0, 2))
    return dest


_STAMP = "dflash_source.json"


def gguf_sha256(gguf: Path) -> str:
    """`file_sha256` of a GGUF file, once per process while the file is unchanged: every load
    of the target (config, tokenizer, identity, model) looks its converted folder up by it."""
    st = Path(gguf).stat()
    return _sha_of(str(Path(gguf).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sha_of(path: str, size: int, mtime_ns: int) -> str:
    return file_sha256(path)


def _converted(root: Path, sha: str, dtype_name: str) -> tuple[Path, dict]:
    """Where the conversion of the file `sha` to `dtype_name` lives, and the stamp it carries."""
    return root / f"{sha[:24]}-{dtype_name}", {"gguf_sha256": sha, "dtype": dtype_name, "convert": CONVERT_VERSION}


def converted_folder(gguf: Path) -> Path | None:
    """A folder `cached_gguf_folder` made of `gguf` already (any dtype, this conversion's version), or None."""
    root = gguf_cache_root()
    if root is None or not root.is_dir():
        return None
    sha = gguf_sha256(gguf)
    for found in sorted(root.glob(f"{sha[:24]}-*")):
        dest, stamp = _converted(root, sha, found.name[len(sha[:24]) + 1:])
        try:
            if is_converted(dest, stamp):
                return dest
        except (OSError, ValueError):
            continue  # an unreadable stamp: not a folder to read
    return None


def is_converted(dest: Path, stamp: dict) -> bool:
    marker = dest / _STAMP
    return marker.is_file() and json.loads(marker.read_text()) == stamp


def convert_gguf(gguf: Path, dest: Path, dtype: torch.dtype, stamp: dict) -> Path:
    """A plain HF folder at `dest` of the GGUF file de-quantised to `dtype`, stamped with `stamp`. Written
    aside and renamed into place, so readers never see half a folder and concurrent converters both work."""
    if is_converted(dest, stamp):
        return dest
    from transformers import AutoModelForCausalLM

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=dest.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is readable as any download is
    try:
        name, kw = _args(gguf)
        with load_bars(f"convert {gguf.name} to {dest.name}", gguf_file=True):  # de-quantised in Python: minutes
            loaded = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kw)
            config = loaded.config
            config.quantization_config = None  # the folder holds float weights
            clean = AutoModelForCausalLM.from_config(config, dtype=dtype)
            clean.load_state_dict(loaded.state_dict(), strict=True)
            clean.save_pretrained(tmp)
        _portable_config(tmp / "config.json")
        load_tokenizer(gguf).save_pretrained(tmp)
        (tmp / _STAMP).write_text(json.dumps(stamp))
        if is_converted(dest, stamp):  # another process finished first: keep the folder it reads
            return dest
        shutil.rmtree(dest, ignore_errors=True)  # a stale conversion
        try:
            os.replace(tmp, dest)
        except OSError:
            if not is_converted(dest, stamp):  # not another process that got there first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _portable_config(path: Path) -> None:
    """Write rope_theta at the top level too: transformers 4.x ignores rope_parameters and uses 10000."""
    cfg = json.loads(path.read_text())
    cfg.pop("quantization_config", None)
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:
        cfg["rope_theta"] = theta
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def gguf_tensors(path: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a GGUF file as float32 [rows, cols]; only their bytes are read (memory-mapped)."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    with ticking(f"read {Path(path).name}", end_line=False):  # its whole index, in Python
        reader = GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        if t.name in names:
            arr = dequantize(t.data, t.tensor_type)  # numpy [rows, cols]
            out[t.name] = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    return out


def default_layer_ids(num_layers: int, n: int = 5) -> list[int]:
    """DFlash spacing: `n` layers uniformly from layer 1 to L-3 (36 -> [1, 9, 17, 25, 33]), the one rule
    both roles' `auto` follows; below 4 layers 0..L-2 (the last is post-norm). ValueError below 2 layers."""
    if num_layers < 2:
        raise ValueError(f"a target needs at least 2 decoder layers, this one has {num_layers}")
    start, end = (1, num_layers - 3) if num_layers >= 4 else (0, num_layers - 2)
    if n == 1:
        return [(start + end) // 2]
    ids = [int(round(start + i * (end - start) / (n - 1))) for i in range(n)]
    return sorted(set(ids))
