"""The project's own client (protocol.links.ProducerLink) over CurveZMQ, as a process:

    python -m tests.reliability.curve_link BROKER RUNS_DIR KEYS NAME

Prints one JSON line: {"run": ..., "lease": n} after a handshake and one lease, or
{"error": "<exception type>", "message": ...} if it could not join.
"""

from __future__ import annotations

import json
import sys

from dflash.protocol.curve import client_keys
from dflash.protocol.errors import DFlashError
from dflash.protocol.links import ProducerLink
from dflash.runtime.logs import close_logging, setup_logging

CONFIG = {"target": "t", "layer_ids": [1], "hidden_size": 4, "dataset": {"n_samples": 8, "fingerprint": "f"}}


def main(broker: str, runs_dir: str, keys: str, name: str) -> None:
    setup_logging("producer", f"link-{name}")
    link = ProducerLink(broker, f"link-{name}", config=CONFIG, runs_dir=runs_dir,
                        curve=client_keys(keys, name), connect_timeout_s=2.0)
    try:
        welcome = link.start()
    except DFlashError as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}))
        return
    try:
        grant = link.request_lease(4, timeout_s=10)
        print(json.dumps({"run": welcome.run, "lease": len(grant.samples)}))
    finally:
        link.close(reason="test")
        close_logging()


if __name__ == "__main__":
    main(*sys.argv[1:5])
