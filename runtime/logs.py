"""structlog setup shared by every role: one JSON object per line, in the run's file
`runs/<run_id>/logs/<role>-<instance>.jsonl` and on stdout (key=value on a TTY).

Lines logged before the run ID is known are held in a bounded buffer and written to the run file
once `bind_run` is called.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
from collections import deque
from datetime import datetime, timezone
from pathlib import Path

import structlog

from .run import make_run_dir

FIRST_KEYS = ("ts", "level", "event", "run_id", "role", "instance", "host", "pid", "gpu")
_PENDING_MAX = 2000


class _RunFile:
    """Where log lines go once the run is known; before that, a bounded pending buffer."""

    def __init__(self):
        # Re-entrant: a signal handler that logs may interrupt the main thread mid-line.
        self.lock = threading.RLock()
        self.file = None
        self.path: Path | None = None
        self.run_id: str | None = None
        self.pending: deque[dict] = deque(maxlen=_PENDING_MAX)
        self.closed = False  # the run is over: later lines are not the next run's
        self.error: str | None = None  # why the file could not be written (then lines go to stdout only)

    def write(self, ev: dict) -> None:
        with self.lock:
            if self.file is None:
                if not self.closed:
                    self.pending.append(ev)
            else:
                try:
                    self.file.write(_dumps(ev) + "\n")
                    self.file.flush()
                except OSError as e:  # a full disk: the line still goes to stdout; the owner asks error()
                    self._failed(e)

    def _failed(self, e: OSError) -> None:
        self.error = f"cannot write {self.path}: {e.strerror or e}"
        try:
            self.file.close()
        except OSError:
            pass  # what the buffer held is lost with the disk's room
        self.file, self.closed = None, True

    def bind(self, run_id: str, path: Path) -> None:
        with self.lock:
            if self.file is not None:
                self.file.close()
            # "a": a peer restarted within a run continues its file; a new run has a new folder
            self.file = open(path, "a", buffering=1)
            self.path, self.run_id, self.closed, self.error = path, run_id, False, None
            for ev in self.pending:
                ev["run_id"] = run_id
                self.file.write(_dumps(ev) + "\n")
            self.pending.clear()

    def close(self) -> None:
        with self.lock:
            if self.file is not None:
                try:
                    self.file.close()
                except OSError as e:
                    self.error = self.error or f"cannot write {self.path}: {e.strerror or e}"
                self.file = None
            self.pending.clear()
            self.closed = True

    def reset(self) -> None:
        """A new configuration starts with nothing held from an earlier one in this process."""
        with self.lock:
            self.close()
            self.path = self.run_id = None
            self.closed = False


_run_file = _RunFile()
_static: dict = {}
_stdout_mode = {"tty": False}


def _dumps(ev: dict) -> str:
    ordered = {k: ev[k] for k in FIRST_KEYS if k in ev}
    ordered.update((k, v) for k, v in ev.items() if k not in ordered)
    return json.dumps(ordered, default=str, allow_nan=True)


def _now_iso_ms() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _add_identity(_logger, method: str, ev: dict) -> dict:
    ev["ts"] = _now_iso_ms()
    ev["level"] = "warning" if method == "warn" else method
    ev["run_id"] = _run_file.run_id
    for k, v in _static.items():
        ev.setdefault(k, v)
    return ev


def _tee_to_run_file(_logger, _method, ev: dict) -> dict:
    _run_file.write(dict(ev))
    return ev


def _render_stdout(_logger, _method, ev: dict) -> str:
    if _stdout_mode["tty"]:
        head = f"{ev['ts'][11:23]} {ev['level']:<7} {ev['event']:<24}"
        rest = " ".join(f"{k}={v}" for k, v in ev.items() if k not in ("ts", "level", "event", "host", "pid"))
        return f"{head} {rest}"
    return _dumps(ev)


def setup_logging(role: str, instance: str, *, gpu: int | None = None, level: str = "info", stream=None) -> None:
    """Configure structlog for this process. Call once at start, before logging."""
    stream = stream or sys.stdout
    _run_file.reset()
    _static.clear()
    _static.update(role=role, instance=instance, host=socket.gethostname(), pid=os.getpid())
    if gpu is not None:
        _static["gpu"] = gpu
    tty = bool(getattr(stream, "isatty", lambda: False)()) and not os.environ.get("DFLASH_LOG_JSON")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _add_identity,
            structlog.processors.format_exc_info,
            _tee_to_run_file,
            _render_stdout,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    _stdout_mode["tty"] = tty


def bind_run(run_id: str, runs_dir=None) -> Path:
    """Start writing this process's lines into the run's folder; returns the file path."""
    d = make_run_dir(run_id, runs_dir)
    path = d / "logs" / f"{_static['role']}-{_static['instance']}.jsonl"
    _run_file.bind(run_id, path)
    return path


def run_file_error() -> str | None:
    """Why the run log file could not be written, or None; the caller decides whether to go on."""
    return _run_file.error


def close_logging() -> None:
    _run_file.close()


def get_logger(**bound):
    """A logger that follows setup_logging even if made before it: never `.bind()` the lazy proxy, which
    would freeze the import-time configuration."""
    return structlog.get_logger(**bound)
