"""transformers' own progress bars while a target loads, routed through runtime/progress.py so no raw
tqdm output lands among the JSON log lines (`with load_bars("load X"): from_pretrained(...)`).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator

from .progress import progress

GGUF_MODULE = "transformers.modeling_gguf_pytorch_utils"


class _Bar:
    """What transformers' loading code uses of a tqdm, reported as `what: <its description>`."""

    def __init__(self, what: str, iterable=None, desc: str | None = None, total=None, *, unit: str = "it",
                 disable: bool = False, **_ignored):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self._iterable = iterable
        self._p = None if disable else progress(f"{what}: {(desc or 'loading').rstrip('. ')}", total, unit,
                                                end_line=False)

    def __iter__(self) -> Iterator:
        try:
            for x in self._iterable:
                yield x
                self.update()
        finally:
            self.close()

    def update(self, n: int = 1) -> None:
        if self._p is not None:
            self._p.update(n)

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **figures) -> None:
        if self._p is not None:
            self._p.note(**dict(ordered_dict or {}), **figures)

    def close(self) -> None:
        if self._p is not None:
            self._p.close()
            self._p = None

    def __enter__(self) -> "_Bar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        """Any other tqdm method (refresh, set_description, clear, ...): nothing to do."""
        return lambda *a, **kw: None


@contextmanager
def load_bars(what: str, *, gguf_file: bool = False):
    """transformers' bars made inside this block report as `what: <desc>` (`gguf_file`: the GGUF reader's too)."""
    import importlib

    from transformers.utils import logging as hf_logging

    previous = hf_logging.set_tqdm_hook(lambda _factory, args, kwargs: _Bar(what, *args, **kwargs))
    gguf = importlib.import_module(GGUF_MODULE) if gguf_file else sys.modules.get(GGUF_MODULE)
    old_tqdm = getattr(gguf, "tqdm", None)
    if old_tqdm is not None:
        gguf.tqdm = lambda *args, **kwargs: _Bar(what, *args, **kwargs)
    try:
        yield
    finally:
        hf_logging.set_tqdm_hook(previous)
        if old_tqdm is not None:
            gguf.tqdm = old_tqdm

