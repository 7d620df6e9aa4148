"""A forged commit (issue 36 item 1). A real broker (plain, and with Curve), a real
`dflash-produce` and a real `dflash-consume` on a tiny target that checkpoints every 2
steps, and a raw client: a zmq DEALER speaking the protocol (protocol/codec.py) that opens a
consumer session (under Curve with a PRODUCER's authorised key), copies the lineage and the
checkpoint of the run's newest commit from the broker's own heartbeat, and sends
`commit {step: 1000000}`, then the same commit at the real step, then a bogus path. Each is
refused (`reject commit_refused`, broker.commit_refused), and the run finishes with every
sample committed exactly once and in the final weights (tests/reliability/chaos_audit.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.protocol import codec
from tests.harness.broker import broker_procs
from tests.harness.curve import CurveBrokerProc, curve_dealer
from tests.reliability.chaos_audit import audit

pytestmark = pytest.mark.integration

N = 16  # samples in the data file


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    for name in ("broker", "good-p", "good-c"):
        subprocess.run([sys.executable, "-m", "dflash.tools.keys", str(d), "--name", name], check=True,
                       capture_output=True, timeout=60)
    return d


class Forger:
    """A raw control client: hello as a consumer, heartbeats, whatever it is told to send."""

    def __init__(self, endpoint: str, keys: Path | None, key_name: str | None):
        self.sock = curve_dealer(endpoint, keys, key_name)
        self.run: str | None = None
        self.rejects: list[dict] = []
        self.last_commit: dict | None = None

    def send(self, type_: str, **fields) -> None:
        h = {"v": 1, "type": type_, **fields}
        if self.run is not None and type_ != "hello":
            h["run"] = self.run
        self.sock.send_multipart(codec.encode(h))

    def read(self, within_s: float) -> None:
        """Read what the broker sends for `within_s`, heartbeating as a live consumer would."""
        end = time.monotonic() + within_s
        while time.monotonic() < end:
            if self.sock.poll(200):
                h = codec.unpack_header(self.sock.recv_multipart()[0])
                if h["type"] == "welcome":
                    self.run = h["run"]
                elif h["type"] == "reject":
                    self.rejects.append(h)
                elif h["type"] == "heartbeat" and (h.get("stats") or {}).get("last_commit"):
                    self.last_commit = h["stats"]["last_commit"]
            if self.run is not None:
                self.send("heartbeat", stats={"state": "waiting"})

    def close(self) -> None:
        self.send("bye", reason="done")
        self.sock.close(linger=1000)


def _data(tmp_path: Path) -> Path:
    import dflash.producers.sample_data as pkg

    rows = (Path(pkg.__file__).parent / "chats.jsonl").read_text().splitlines()[:N]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(rows) + "\n")
    return data


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_a_forged_commit_is_refused_and_every_sample_is_committed_once_and_in_the_weights(tmp_path, keys, curve):
    from dflash.tools.tiny import tiny_target

    make = (lambda runs, args: CurveBrokerProc(runs, args, keys, "good-c")) if curve else None
    with broker_procs(tmp_path / "runs", *([make] if make else [])) as start:
        b = start("--epochs", "1", "--lease-size", "4", "--timeout-s", "60",
                  "--heartbeat-s", "0.3")
        target, runs = str(tiny_target()), str(tmp_path / "runs")
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}, "OMP_NUM_THREADS": "1"}
        auth = (lambda name: ["--curve-keys", str(keys), "--curve-name", name]) if curve else (lambda name: [])

        def spawn(module: str, *args: str) -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-m", module, "--broker", b.control, "--runs-dir", runs, *args],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

        procs = [spawn("dflash.producers.produce_command", "--device", "cpu", "--target", target, "--data",
                       str(_data(tmp_path)), "--max-length", "512", "--token-budget", "512", "--max-batch-size", "2",
                       "--instance", "p", *auth("good-p")),
                 spawn("dflash.consumers.process.consume_command", "--target", target, "--block-size", "8", "--anchors",
                       "32", "--draft-layers", "1", "--save-every", "2", "--instance", "c", *auth("good-c"))]
        forger = Forger(b.control, keys if curve else None, "good-p" if curve else None)  # a producer's key
        try:
            forger.send("hello", role="consumer", instance="forger", host="elsewhere", pid=1)
            end = time.monotonic() + 240
            while forger.last_commit is None and time.monotonic() < end and procs[1].poll() is None:
                forger.read(0.5)
            last = forger.last_commit
            assert last is not None, "the run made no commit"
            stolen = {k: last[k] for k in ("checkpoint", "lineage") if last.get(k) is not None}
            forger.send("commit", step=1_000_000, **stolen)
            forger.send("commit", step=last["step"], **stolen)
            forger.read(1.0)
            forger.send("commit", step=last["step"], checkpoint="/no/such/checkpoint", lineage=last["lineage"])
            forger.read(1.5)
            forger.close()
            outs = [p.communicate(timeout=240)[0] for p in procs]
            assert [p.returncode for p in procs] == [0, 0], [o[-3000:] for o in outs]
            assert b.proc.wait(60) == 0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        assert [r["code"] for r in forger.rejects] == ["commit_refused"] * 3, forger.rejects
        assert [r["answers"]["step"] for r in forger.rejects] == [1_000_000, last["step"], last["step"]]
        refused = b.events("broker.commit_refused")
        assert len(refused) == 3 and {e["why"] for e in refused} == {"not_lineage_consumer"}
        forger_id = refused[0]["peer"]
        assert forger_id not in {e["peer"] for e in b.events("broker.commit")}
        a = audit(Path(runs), [b.run_id], 1, N)
        assert not a.lost and not a.duplicated and not a.unexpected, (a.lost, a.duplicated, a.unexpected)
        assert a.record_complete and a.final_checkpoint.is_dir()
        assert b.events("broker.checkpoints_readable")  # the broker reads this run's checkpoints
