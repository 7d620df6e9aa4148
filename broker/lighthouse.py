"""The torchft lighthouse of an elastic consumer job (docs/RELIABILITY.md section 8): consumers meet
there each step, so a dead one is left out and a rejoining one healed. It holds no training state.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from dflash.runtime.logs import get_logger

log = get_logger()

# Wait for a heartbeating replica to join before forming a quorum without it (it joins the next).
JOIN_TIMEOUT_MS = 30_000


class Lighthouse:
    def __init__(self, server, address: str):
        self.server, self.address = server, address

    def close(self) -> None:
        self.server.shutdown()


def start(bind: str, port: int, advertise: str, timeout_s: float) -> Lighthouse | None:
    """A lighthouse on `bind:port`, or None (logged) when torchft cannot run here."""
    # torchft's Rust side logs every quorum request at INFO; an operator's RUST_LOG wins
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        from torchft._torchft import LighthouseServer
    except Exception as e:  # ImportError, or a torch too old for torchft
        log.warning("broker.elastic_unavailable", error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                    hint="pip install torchft (needs torch >= 2.7); consumers form a fixed group meanwhile")
        return None
    host = "0.0.0.0" if bind in ("*", "0.0.0.0") else ("[::]" if bind in ("::", "[::]") else bind)
    try:
        server = LighthouseServer(bind=f"{host}:{port}", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                                  heartbeat_timeout_ms=int(timeout_s * 1000))
    except RuntimeError as e:  # e.g. the port is taken: a start failure like a socket's
        raise OSError(f"lighthouse on {host}:{port}: {e}") from e
    bound = urlsplit(server.address()).port
    address = f"http://{advertise}:{bound}"
    log.info("broker.lighthouse", address=address, bind=f"{host}:{bound}", heartbeat_timeout_s=timeout_s,
             join_timeout_s=JOIN_TIMEOUT_MS / 1000)
    return Lighthouse(server, address)
