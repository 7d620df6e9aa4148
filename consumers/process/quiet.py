"""Library noise kept off the consumer's terminal (issue 20): lines that say nothing to a
user, mixed with the JSON log lines. Errors still come through; only these go:

  - torchft's warning "Unable to reset NCCL flight recorder recording" at every quorum,
    printed on builds without NCCL's flight recorder (every CPU/gloo run), where there is
    no NCCL trace to reset;
  - the access line ("GET /checkpoint/0/full HTTP/1.1" 200) that Python's http.server
    prints to stderr for each request to torchft's checkpoint server, the heal transport.
"""

from __future__ import annotations

import logging


class _DropFlightRecorder(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "NCCL flight recorder" not in record.getMessage()


def quiet_library_noise() -> None:
    """Install both filters (idempotent)."""
    manager_logger = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _DropFlightRecorder) for f in manager_logger.filters):
        manager_logger.addFilter(_DropFlightRecorder())
    try:
        import torchft.http as http
    except ImportError:  # nothing of torchft's to quiet (a fixed group or a single consumer)
        return

    server = http._IPv6HTTPServer
    if getattr(server, "_dflash_quiet", False):
        return
    init = server.__init__

    def __init__(self, address, handler, *args, **kw):
        # log_request is the access line; log_error (a failed request) still prints
        quiet = type(handler.__name__, (handler,), {"log_request": lambda _self, code="-", size="-": None})
        init(self, address, quiet, *args, **kw)

    server.__init__ = __init__
    server._dflash_quiet = True
