"""`--metrics-port`: the status map as Prometheus text on `http://HOST:PORT/metrics`.

For people who already watch their GPUs in Grafana: the same figures `dflash-status`
shows, scraped. Plain `http.server` in one daemon thread, no new dependency.

The broker's state belongs to its loop thread (nothing there is locked), so this thread
never reads it: the loop publishes a finished status map every heartbeat (`publish`),
and a scrape renders the latest one. Maps are never changed after publication, so
handing one over is a single reference assignment.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (metric, help, path into the map); gauges unless the name ends in _total
RUN_METRICS = (
    ("dflash_queue_batches", "Batches waiting in the shared queue.", ("queue", "batches")),
    ("dflash_queue_bytes", "Bytes waiting in the shared queue.", ("queue", "bytes")),
    ("dflash_queue_capacity_bytes", "Queue bound (--queue-bytes).", ("queue", "capacity_bytes")),
    ("dflash_queue_oldest_age_seconds", "Age of the oldest queued batch.", ("queue", "oldest_age_s")),
    ("dflash_queue_full_ratio", "Share of the last 10 s the queue was full (targets blocked).", ("queue", "full_frac")),
    ("dflash_in_flight_batches", "Batches delivered to consumers, not yet acked.", ("queue", "in_flight_batches")),
    ("dflash_samples", "Samples of the run (n_samples x epochs).", ("progress", "total")),
    ("dflash_samples_trained", "Samples trained (committed included).", ("progress", "trained")),
    ("dflash_samples_committed", "Samples in a durable checkpoint.", ("progress", "committed")),
    ("dflash_epochs_done", "Epochs done, fractional.", ("progress", "epochs_done")),
    ("dflash_samples_per_second", "Samples trained per second (last minute).", ("progress", "samples_per_s")),
    ("dflash_eta_seconds", "Seconds to the end of the run at the current pace.", ("progress", "eta_s")),
    ("dflash_batches_in_total", "Batches received from producers.", ("rates", "batches_in")),
    ("dflash_batches_out_total", "Batches sent to consumers.", ("rates", "batches_out")),
    ("dflash_uptime_seconds", "Seconds since the broker started.", ("broker", "uptime_s")),
)
# (metric, help, row key, roles)
PEER_METRICS = (
    ("dflash_peer_tokens_per_second", "Tokens/s measured by the broker (in from producers, out to consumers).",
     "tokens_per_s", ("producer", "consumer")),
    ("dflash_peer_heartbeat_age_seconds", "Seconds since the peer was last heard.", "heartbeat_age_s",
     ("producer", "consumer")),
    ("dflash_peer_gpu_memory_used_bytes", "GPU memory used (device-wide).", "gpu_mem_used", ("producer", "consumer")),
    ("dflash_peer_gpu_memory_total_bytes", "GPU memory of the device.", "gpu_mem_total", ("producer", "consumer")),
    ("dflash_peer_gpu_utilization_percent", "GPU utilisation (NVML).", "gpu_util", ("producer", "consumer")),
    ("dflash_peer_oom_backoff", "1 while the peer sends smaller batches after an OOM.", "oom_backoff",
     ("producer", "consumer")),
    ("dflash_producer_prefetch_depth", "Prepared batches waiting for the target (q_pre).", "q_pre", ("producer",)),
    ("dflash_producer_in_flight_samples", "Leased samples not yet arrived.", "in_flight", ("producer",)),
    ("dflash_consumer_step", "Optimizer step.", "step", ("consumer",)),
    ("dflash_consumer_loss", "Training loss.", "loss", ("consumer",)),
    ("dflash_consumer_acc", "Block accuracy.", "acc", ("consumer",)),
    ("dflash_consumer_streak", "Mean correct streak in a block.", "streak", ("consumer",)),
    ("dflash_consumer_credit", "Batches the consumer has room for.", "credit", ("consumer",)),
    ("dflash_consumer_in_flight_batches", "Batches delivered, not yet acked.", "in_flight", ("consumer",)),
    ("dflash_consumer_wait_ratio", "Share of the last 10 s it had credit and nothing to get.", "wait_frac",
     ("consumer",)),
)


def render(st: dict) -> str:
    """Prometheus text exposition (format 0.0.4) of one status map."""
    run = {"run_id": st.get("run_id") or ""}
    out: list[str] = []
    _family(out, "dflash_run_info", "The run this broker serves (value 1).", "gauge",
            [({**run, "started_at": (st.get("broker") or {}).get("started_at") or ""}, 1)])
    for name, help_, path in RUN_METRICS:
        v = st
        for k in path:
            v = (v or {}).get(k)
        kind = "counter" if name.endswith("_total") else "gauge"
        _family(out, name, help_, kind, [(run, v)])
    peers = st.get("peers") or []
    for name, help_, key, roles in PEER_METRICS:
        samples = [({**run, **_peer_labels(p)}, p.get(key)) for p in peers if p.get("role") in roles]
        _family(out, name, help_, "gauge", samples)
    gone: dict[tuple, int] = {}
    for g in st.get("gone") or []:
        gone[(g.get("role"), g.get("state"))] = gone.get((g.get("role"), g.get("state")), 0) + 1
    _family(out, "dflash_peers_gone", "Lost or departed peers among the last 32.", "gauge",
            [({**run, "role": r or "", "state": s or ""}, n) for (r, s), n in sorted(gone.items())])
    d = st.get("diagnosis") or {}
    _family(out, "dflash_diagnosis", "What limits throughput now (value 1; text in dflash-status).", "gauge",
            [({**run, "code": d.get("code") or "", "limited_by": d.get("limited_by") or ""}, 1)] if d else [])
    return "\n".join(out) + "\n"


def _peer_labels(p: dict) -> dict:
    gpu = p.get("gpu")
    return {"peer": p.get("peer") or "", "role": p.get("role") or "", "instance": p.get("instance") or "",
            "host": p.get("host") or "", "gpu": "" if gpu is None else str(gpu)}


def _family(out: list[str], name: str, help_: str, kind: str, samples: list[tuple[dict, object]]) -> None:
    lines = [f"{name}{_labels(lb)} {_value(v)}" for lb, v in samples if _value(v) is not None]
    if lines:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *lines]


def _labels(lb: dict) -> str:
    if not lb:
        return ""
    return "{" + ",".join(f'{k}="{_escaped(v)}"' for k, v in lb.items()) + "}"


def _escaped(s) -> str:
    """A label value as the text format writes it: backslash, quote and newline escaped."""
    return str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _value(v) -> str | None:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, (int, float)):
        return repr(float(v)) if isinstance(v, float) else str(v)
    return None


class MetricsServer:
    """`GET /metrics` on (bind, port) from the last published status map.

    Raises OSError when the port cannot be bound (the broker then does not start)."""

    def __init__(self, bind: str, port: int):
        self._latest: tuple[float, dict] | None = None
        host = "" if bind in ("*", "0.0.0.0") else bind  # http.server's "all interfaces"
        self.httpd = HTTPServer((host, port), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)
        self.thread.start()

    def publish(self, status: dict) -> None:
        self._latest = (time.monotonic(), status)  # one assignment: the reader sees old or new

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 5  # a client that stalls mid-request cannot hold the one thread for long

            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] != "/metrics":
                    return self._send(404, "only /metrics here\n")
                latest = server._latest
                if latest is None:
                    return self._send(503, "no status published yet\n")
                at, st = latest
                body = render(st) + (f"# HELP dflash_status_age_seconds Age of this snapshot.\n"
                                     f"# TYPE dflash_status_age_seconds gauge\n"
                                     f"dflash_status_age_seconds {time.monotonic() - at:.3f}\n")
                self._send(200, body)

            def _send(self, code: int, body: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_args):  # scrapes every few seconds would flood stderr
                pass

        return Handler
