"""The one graceful-stop handler of every role: SIGINT/SIGTERM ask the process to stop.

The handler only records the request: the main thread it interrupts may hold the log file's lock,
so logging there could deadlock. The process's own loop acts on it and logs.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulStop(threading.Event):
    """Set by the first SIGINT/SIGTERM once installed. With `hard_second`, a second signal (or any while
    not `armed`) kills the process at once; `on_signal` runs in the handler and must not log or block."""

    def __init__(self, *, hard_second: bool = True, armed: bool = True,
                 on_signal: Callable[["GracefulStop"], None] | None = None):
        super().__init__()
        self.hard_second, self.armed, self.on_signal = hard_second, armed, on_signal
        self.signal_name: str | None = None
        self.count = 0
        self._previous: dict = {}

    def install(self) -> "GracefulStop":
        """Take over SIGINT and SIGTERM (main thread only); `restore` puts the old ones back."""
        self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum, _frame) -> None:
        if self.hard_second and (self.is_set() or not self.armed):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.count += 1
        self.signal_name = signal.Signals(signum).name
        self.set()
        if self.on_signal is not None:
            self.on_signal(self)
