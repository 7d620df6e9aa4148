"""Progress of a long command: a tqdm bar on a terminal, a `progress.update` log line now and then
otherwise (a pipe, a file, CI), so nobody waits on a silent command and logs stay JSON.

`progress(what, total)` counts (`update`, `note` figures); `ticking(what)` shows elapsed time for a
step nothing counts. `DFLASH_PROGRESS=bar|log|off` forces a mode, `DFLASH_PROGRESS_EVERY_S` the log pace.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

from .logs import get_logger

log = get_logger()

LOG_EVERY_S = 30.0  # a log line at most this often (and one at the end)
REDRAW_S = 0.1  # a bar redrawn for a noted figure at most this often (a GPU notes thousands a second)


def log_every_s() -> float:
    """DFLASH_PROGRESS_EVERY_S, else LOG_EVERY_S."""
    raw = os.environ.get("DFLASH_PROGRESS_EVERY_S", "").strip()
    try:
        return max(0.0, float(raw)) if raw else LOG_EVERY_S
    except ValueError:
        return LOG_EVERY_S


class Progress:
    """One long task's counter; see the module docstring. `clock` is injected for tests."""

    def __init__(self, what: str, total: int | None, unit: str, *, mode: str, every_s: float | None = None,
                 clock=time.monotonic, stream=None, end_line: bool = True, bar_format: str | None = None):
        self.what, self.total, self.unit, self.mode = what, total, unit, mode
        self.done = 0
        self.figures: dict = {}
        self._clock, self._every = clock, log_every_s() if every_s is None else every_s
        # end_line=False: a task shorter than one interval ends without a line (its caller logs the end)
        self._end_line, self._logged = end_line, False
        self._t0 = self._last = self._drawn = clock()
        self._said: tuple | None = None  # (done, figures) of the last log line: the end line is not its repeat
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            stream = stream or sys.stderr
            try:  # a terminal that reports no size (a bare pseudo-terminal) gets tqdm's default width
                sized = os.get_terminal_size(stream.fileno()).columns > 0
            except (OSError, ValueError, AttributeError):
                sized = False
            self._bar = tqdm(total=total, desc=what, unit=unit, file=stream, dynamic_ncols=sized,
                             ncols=None if sized else 100, nrows=None if sized else 24, smoothing=0.1,
                             bar_format=bar_format)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.mode == "log" and self._clock() - self._last >= self._every:
            self._log()

    def tick(self) -> None:
        """Show that the task goes on without counting: redraw the bar, or log when due."""
        if self._bar is not None:
            self._bar.refresh()
        elif self.mode == "log" and self._clock() - self._last >= self._every:
            self._log()

    def note(self, redraw: bool = False, **figures) -> None:
        """Figures shown beside the bar and in each log line; `redraw`: they move while the count stands still."""
        self.figures.update(figures)
        if self._bar is not None:
            self._bar.set_postfix(self.figures, refresh=False)
            if redraw and self._clock() - self._drawn >= REDRAW_S:
                self._drawn = self._clock()
                self._bar.refresh()
        elif redraw:
            self.tick()

    def _log(self) -> None:
        now = self._clock()
        self._last, self._logged = now, True
        self._said = (self.done, dict(self.figures))
        elapsed = max(now - self._t0, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if self.total and rate > 0 else None
        log.info("progress.update", what=self.what, done=self.done, total=self.total, unit=self.unit,
                 rate_per_s=round(rate, 2), elapsed_s=round(elapsed, 1),
                 eta_s=None if eta is None else round(eta, 1), **self.figures)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.mode == "log" and (self._end_line or self._logged) and self._said != (self.done, self.figures):
            self._log()  # the end's figures, unless the last line already said them

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_mode(stream=None) -> str:
    """'bar' on a terminal, 'log' otherwise; DFLASH_PROGRESS overrides (bar, log, off)."""
    forced = os.environ.get("DFLASH_PROGRESS", "").strip().lower()
    if forced in ("bar", "log", "off"):
        return forced
    stream = stream or sys.stderr
    return "bar" if getattr(stream, "isatty", lambda: False)() else "log"


def progress(what: str, total: int | None = None, unit: str = "it", **kw) -> Progress:
    """A Progress for `what` in the mode that fits where stderr goes (progress_mode)."""
    return Progress(what, total, unit, mode=progress_mode(kw.get("stream")), **kw)


@contextmanager
def ticking(what: str, every_s: float = 1.0, **kw):
    """A step that cannot be counted: its elapsed time redrawn every `every_s` by a thread; yields the Progress."""
    bar = progress(what, None, "step", bar_format="{desc}: {elapsed} elapsed{postfix}", **kw)
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every_s):
            bar.tick()

    thread = threading.Thread(target=beat, name="dflash-progress", daemon=True)
    thread.start()
    try:
        yield bar
    finally:
        done.set()
        thread.join()
        bar.close()
