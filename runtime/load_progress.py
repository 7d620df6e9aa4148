"""transformers' own progress bars while a target loads ("Loading weights", "Loading
checkpoint shards", "Converting and de-quantizing GGUF tensors...", "Writing model shards")
through runtime/progress.py: a bar on a terminal, `progress.update` log lines otherwise,
never raw tqdm output among the JSON log lines (which is why they were turned off, and why a
minutes-long load of a large target said nothing).

    with load_bars("load Qwen/Qwen3-8B"):
        model = AutoModelForCausalLM.from_pretrained(...)

transformers creates its bars through `transformers.utils.logging.tqdm`, which calls the
hook of `set_tqdm_hook` (5.x, the versions this project supports); its GGUF reader uses
`tqdm.auto.tqdm` by its module's own name, swapped here for the same bar while the block runs.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator

from .progress import progress

GGUF_MODULE = "transformers.modeling_gguf_pytorch_utils"


class _Bar:
    """What transformers' loading code uses of a tqdm (iterating what it wraps, update,
    set_postfix, close, `with`), reported as `what: <its description>`. Parts of a load end
    without a line of their own when short (the caller logs the load)."""

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
    """transformers' progress bars created inside this block report as `what: <desc>`;
    `gguf_file`: the block reads a .gguf file (its de-quantisation bar too)."""
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

