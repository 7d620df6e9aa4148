"""A real multi-host run: broker, producer and consumer each in its own network namespace
(its own network stack, interface and address), training over those addresses.

Skipped, with the reason printed, only where namespaces cannot be made (not root, no
iproute2, no CAP_NET_ADMIN)."""

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multihost.netns import Hosts, NetnsUnavailable

from dflash.tools.tiny import tiny_target  # noqa: E402

pytestmark = pytest.mark.integration

PORT = 5555


@pytest.fixture
def hosts():
    h = Hosts()
    try:
        h.create(["broker", "producer", "consumer"])
    except NetnsUnavailable as e:
        h.destroy()
        print(f"SKIPPED multi-host test: {e}")
        pytest.skip(f"network namespaces unavailable: {e}")
    yield h
    h.destroy()


def _subset(tmp_path, n=40) -> Path:
    import dflash.producers.sample_data as pkg

    rows = (Path(pkg.__file__).parent / "chats.jsonl").read_text().splitlines()[:n]
    out = tmp_path / "chats.jsonl"
    out.write_text("\n".join(rows) + "\n")
    return out


@pytest.mark.netns
def test_training_across_three_network_namespaces(hosts, tmp_path):
    target, data, runs = tiny_target(), _subset(tmp_path), tmp_path / "runs"
    b = hosts.addresses["broker"]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")},
           "OMP_NUM_THREADS": "1", "DFLASH_LOG_JSON": "1"}
    common = ["--runs-dir", str(runs)]
    argv = {
        "broker": [sys.executable, "-m", "dflash.broker.broker_command", "--bind", b, "--advertise-host", b,
                   "--port", str(PORT), "--data-in-port", str(PORT + 1), "--data-out-ports", f"{PORT + 2}-{PORT + 5}",
                   "--epochs", "2", "--consumers", "1", *common],
        "producer": [sys.executable, "-m", "dflash.producers.produce_command", "--broker", f"tcp://{b}:{PORT}",
                     "--device", "cpu", "--target", str(target), "--data", str(data), "--max-length", "512",
                     "--token-budget", "2048", "--instance", "nsP", *common],
        "consumer": [sys.executable, "-m", "dflash.consumers.process.consume_command", "--broker", f"tcp://{b}:{PORT}",
                     "--target", str(target), "--block-size", "8", "--anchors", "32", "--draft-layers", "1",
                     "--instance", "nsC", *common],
    }
    procs = {}
    try:
        for name in ("broker", "producer", "consumer"):
            procs[name] = subprocess.Popen(hosts.exec_argv(name, argv[name]), stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True, env=env)
            if name == "broker":
                time.sleep(2)
        outs = {n: p.communicate(timeout=240)[0] for n, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for n, p in procs.items():
        assert p.returncode == 0, f"{n} exited {p.returncode}:\n{outs[n][-3000:]}"

    run_dir = next(d for d in runs.iterdir() if d.is_dir() and not d.is_symlink())
    con = sqlite3.connect(run_dir / "ledger.sqlite")
    states = dict(con.execute("SELECT state, COUNT(*) FROM samples GROUP BY state"))
    assert states == {"committed": 2 * 40}, states
    steps = [json.loads(line) for line in (run_dir / "logs" / "consumer-nsC.jsonl").read_text().splitlines()]
    assert any(e["event"] == "train.step" for e in steps)
    # Each role ran in its own namespace with its own interface; the broker bound only its
    # namespace's address, so the producer and consumer reached it over the bridge.
    joined = [json.loads(line) for line in (run_dir / "logs" / "broker-main.jsonl").read_text().splitlines()]
    assert {e["peer_instance"] for e in joined if e["event"] == "broker.peer_joined"} == {"nsP", "nsC"}
