"""`dflash-broker --metrics-port`: the status map as Prometheus text, scraped over real HTTP
from a live broker, plus the exposition format on a hand-written map."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from dflash.protocol.sockets import free_port_block
from dflash.broker.metrics import render
from tests.harness.wait import wait_for

pytestmark = pytest.mark.integration

LINE = re.compile(r'^([a-z_]+)(\{(?:[a-z_]+="(?:[^"\\]|\\.)*",?)*\})? (-?[0-9.e+-]+|NaN)$')


def parse(text: str) -> dict[str, list[tuple[str, float]]]:
    """{metric: [(labels, value)]}; AssertionError on a line that is not exposition format."""
    out: dict[str, list] = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        m = LINE.match(line)
        assert m, f"not Prometheus text: {line!r}"
        out.setdefault(m.group(1), []).append((m.group(2) or "", float(m.group(3))))
    return out


def test_render_escapes_labels_and_skips_unknown_values():
    st = {"run_id": "r1", "broker": {"started_at": "2026-11-29T15:48:12.000Z", "uptime_s": 3.5},
          "queue": {"batches": 4, "bytes": 4096, "reading": False, "full_frac": 0.5, "oldest_age_s": None},
          "progress": {"eta_s": None, "trained": 10},
          "peers": [{"peer": "c1", "role": "consumer", "instance": 'we"ird\\name', "host": "h", "gpu": 5,
                     "tokens_per_s": 12.5, "oom_backoff": True, "loss": None, "step": 7}],
          "gone": [{"role": "consumer", "state": "lost"}, {"role": "consumer", "state": "lost"}],
          "diagnosis": {"code": "peer_lost", "limited_by": "drafters"}}
    text = render(st)
    m = parse(text)
    assert m["dflash_queue_batches"] == [('{run_id="r1"}', 4.0)]
    assert "dflash_queue_oldest_age_seconds" not in m and "dflash_eta_seconds" not in m  # null: left out
    assert "dflash_consumer_loss" not in m and m["dflash_consumer_step"][0][1] == 7
    labels, value = m["dflash_peer_oom_backoff"][0]
    assert value == 1 and 'instance="we\\"ird\\\\name"' in labels and 'gpu="5"' in labels
    assert m["dflash_peers_gone"] == [('{run_id="r1",role="consumer",state="lost"}', 2.0)]
    assert m["dflash_diagnosis"] == [('{run_id="r1",code="peer_lost",limited_by="drafters"}', 1.0)]
    assert "# TYPE dflash_batches_in_total counter" not in text  # no value, no family
    assert text.count("# TYPE dflash_queue_batches gauge") == 1


def test_live_broker_serves_metrics(start_broker, fakes):
    port = free_port_block(1)
    b = start_broker("--metrics-port", str(port))
    fakes("producer", b, "--instance", "tgt0", "--gpu", "0", "--delay-s", "0.02")
    fakes("consumer", b, "--instance", "dft5", "--gpu", "5", "--train-s", "0.02")
    url = f"http://127.0.0.1:{port}/metrics"

    def scrape():
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                return parse(r.read().decode())
        except urllib.error.HTTPError as e:  # 503 until the first heartbeat published a map
            assert e.code == 503
            return None

    m = wait_for(scrape, lambda m: (m.get("dflash_consumer_step") or [("", 0)])[0][1] > 3, 20, every_s=0.3)
    assert m["dflash_run_info"][0][0].startswith(f'{{run_id="{b.run_id}",started_at="')
    assert m["dflash_samples"][0][1] == 5000 and m["dflash_batches_in_total"][0][1] > 0
    tps = {lb: v for lb, v in m["dflash_peer_tokens_per_second"]}
    assert any('instance="tgt0"' in lb and 'role="producer"' in lb and 'gpu="0"' in lb and v > 0
               for lb, v in tps.items())
    assert m["dflash_peer_gpu_memory_total_bytes"][0][1] == 96 * 2**30
    assert len(m["dflash_diagnosis"]) == 1 and m["dflash_status_age_seconds"][0][1] < 5
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=2)
    assert e.value.code == 404
    assert f"http://127.0.0.1:{port}/metrics" == b.status["broker"]["endpoints"]["metrics"]


def _broker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash.broker.broker_command", *args], capture_output=True, text=True,
                          timeout=30)


def test_metrics_port_clash_and_port_in_use_fail_in_one_line(tmp_path):
    base = free_port_block(4)
    ports = ["--bind", "127.0.0.1", "--port", str(base), "--data-in-port", str(base + 1), "--data-out-ports",
             f"{base + 2}-{base + 3}", "--runs-dir", str(tmp_path)]
    from click.testing import CliRunner

    from dflash.broker.broker_command import main

    r = CliRunner().invoke(main, [*ports, "--metrics-port", str(base)])  # refused before anything starts
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "--metrics-port" in r.stderr
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    taken = busy.getsockname()[1]
    try:
        r = _broker(*ports, "--metrics-port", str(taken))
    finally:
        busy.close()
    assert r.returncode == 1 and "cannot bind" in r.stderr and str(taken) in r.stderr
