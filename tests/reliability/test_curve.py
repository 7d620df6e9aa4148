"""CurveZMQ (issue 7): with --curve-keys, authorised peers run normally, and a peer without
an authorised key can neither connect, nor send, nor read anything on any broker socket:
control, data in, or a consumer's data out. Traffic on the wire is encrypted."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import json
import os
import random

import msgpack
import pytest
import zmq
from tests.harness.broker import broker_procs
from tests.reliability.fuzz_messages import batch
from tests.harness.curve import CurveBrokerProc, curve_dealer, curve_status
from tests.harness.ledger import committed
from tests.harness.spawn import COMMITTING, child_env, finish, module_argv, rss_kib, spawn
from tests.harness.wait import wait_until
from tests.reliability.zmtp_raw import RawZmtp

from dflash.protocol.curve import client_keys

pytestmark = pytest.mark.integration

N_SAMPLES = 40


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """broker, good-p, good-c authorised; intruder has a keypair the broker does not know."""
    d = tmp_path_factory.mktemp("keys")
    for name, extra in [("broker", []), ("good-p", []), ("good-c", []), ("intruder", ["--no-authorize"])]:
        subprocess.run([sys.executable, "-m", "dflash.tools.keys", str(d), "--name", name, *extra], check=True,
                       capture_output=True, timeout=60)
    assert sorted(p.name for p in (d / "authorized").iterdir()) == ["good-c.key", "good-p.key"]
    return d


@pytest.fixture
def curve_broker(tmp_path, keys):
    """`curve_broker(*args)`: a broker with --curve-keys, probed as good-c."""
    with broker_procs(tmp_path / "runs", lambda runs, args: CurveBrokerProc(runs, args, keys, "good-c")) as start:
        yield start


def _silent(sock: zmq.Socket, within_s: float) -> bool:
    return not sock.poll(int(within_s * 1000))


def _hello(role: str, instance: str) -> bytes:
    return msgpack.packb({"v": 1, "type": "hello", "role": role, "instance": instance, "host": "x", "pid": 1})


def test_only_authorised_keys_connect_send_or_read(curve_broker, keys):
    t0 = time.monotonic()
    b = curve_broker("--lease-size", "4")
    ctx = zmq.Context.instance()
    # control: an unknown key, and no Curve at all, get no answer to hello or status
    for name in ("intruder", None):
        s = curve_dealer(b.control, keys if name else None, name)
        try:
            s.send(_hello("consumer", f"in-{name}"))
            s.send(msgpack.packb({"v": 1, "type": "status"}))
        except zmq.Again:
            pass  # the refused handshake dropped the pipe: nothing could even be queued
        assert _silent(s, 2.0), f"the broker answered {name or 'a plain client'}"
        s.close()

    cons = spawn(COMMITTING, "consumer", b, "--instance", "c", "--train-s", "0.05", "--curve-keys", str(keys),
                 "--curve-name", "good-c")
    row = wait_until(lambda: [r for r in (b.ask() or {}).get("peers", []) if r["instance"] == "c"], 20, "consumer")
    # data out: an intruder PULL on the consumer's own pipe would get every other batch
    # (PUSH round-robins) if it could connect
    thief = ctx.socket(zmq.PULL)
    client_keys(keys, "intruder").apply(thief)
    thief.connect(row[0]["data_out"])
    stolen: list = []
    stop = threading.Event()
    reader = threading.Thread(target=_drain, args=(thief, stolen, stop), daemon=True)
    reader.start()
    time.sleep(0.3)
    prod = spawn(COMMITTING, "producer", b, "--instance", "p", "--n-samples", str(N_SAMPLES), "--delay-s", "0.01",
                 "--curve-keys", str(keys), "--curve-name", "good-p")
    b.wait_event("broker.lease_granted", 20)

    # data in: a batch pushed with an unknown key never arrives; the same frames with an
    # authorised key do (and are logged as stale: proof the broker would have said so)
    for name, marker in (("intruder", "evil-1"), ("good-p", "probe-1")):
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        client_keys(keys, name).apply(push)
        push.connect(f"tcp://127.0.0.1:{b.port + 1}")
        push.send_multipart(batch(b.run_id, "p1", random.Random(1), batch_id=marker), flags=zmq.NOBLOCK)
        time.sleep(0.5)
        push.close()
    b.wait_event("broker.batch_stale", 5, lambda e: e["batch_id"] == "probe-1")

    # a raw ZMTP client speaking NULL to a CURVE socket is dropped at the greeting
    rss0 = rss_kib(b.proc.pid)
    for port in (b.port, b.port + 1):
        try:
            raw = RawZmtp("127.0.0.1", port, b"PUSH")
            for _ in range(32):
                raw.send_frame(b"\x00" * (1 << 20), more=True)
            closed = raw.closed_by_peer(3.0)
        except (ConnectionError, OSError):
            closed = True
        assert closed
    assert rss_kib(b.proc.pid) - rss0 < 16 * 1024

    assert finish([cons, prod], 60) == [0, 0], [p.output[-2000:] for p in (cons, prod)]
    assert b.proc.wait(20) == 0
    stop.set()
    reader.join(5)
    thief.close(linger=0)
    assert stolen == [], f"an unauthorised PULL read {len(stolen)} batches"
    assert len(committed(b.run_dir)) == N_SAMPLES
    lines = "\n".join(b.lines)
    assert "evil-1" not in lines and "in-intruder" not in lines and "in-None" not in lines
    joined = {e["peer_instance"]: e["curve_key"] for e in b.events("broker.peer_joined")}
    assert joined == {"c": "good-c", "p": "good-p"}
    intruder_pub = (keys / "intruder.key").read_text().split('public-key = "')[1].split('"')[0]
    assert any(e["key"] == intruder_pub for e in b.events("broker.curve_denied"))
    print(f"curve: run completed, intruders refused on every socket, {time.monotonic() - t0:.1f}s")


def _drain(sock: zmq.Socket, out: list, stop: threading.Event) -> None:
    """Keep whatever `sock` receives until `stop` (the only user of `sock` meanwhile)."""
    while not stop.is_set():
        if sock.poll(50):
            out.append(sock.recv_multipart())


def test_peerlink_with_curve_joins_and_an_unknown_key_gets_a_named_error(curve_broker, keys, tmp_path):
    b = curve_broker()

    def link(name: str) -> dict:
        out = subprocess.run(module_argv("tests.reliability.curve_link", b.control, str(tmp_path / "runs"), str(keys),
                                         name), capture_output=True, text=True, timeout=60, env=child_env())
        said = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        return next(d for d in said if "event" not in d)  # the script's answer, not a log line

    assert link("good-p") == {"run": b.run_id, "lease": 4}  # both directions of the control socket work
    bad = link("intruder")
    assert bad["error"] == "BrokerUnreachable" and "'intruder' in the broker's authorized/ folder" in bad["message"]


def test_a_client_with_plain_tcp_or_another_brokers_key_leaves_a_trace_in_the_log(curve_broker, brokers, keys):
    """Issue 29 item 8: such a client never gets a message through, so only the sockets'
    monitor sees it; the broker logs it (broker.handshake_failed) with what it means."""
    b, p = curve_broker(), brokers()  # both bound before the refused clients churn through local ports

    def client(endpoint: str, kind: int = zmq.DEALER, curve=None) -> zmq.Socket:
        s = zmq.Context.instance().socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, 5000)  # one attempt is enough to be seen
        s.setsockopt(zmq.SNDTIMEO, 2000)  # a failed handshake may leave no pipe to queue on
        if curve is not None:
            curve.apply(s)
        s.connect(endpoint)
        return s

    mine = client_keys(keys, "good-c")
    another_broker = type(mine)(mine.public, mine.secret, zmq.curve_keypair()[0], "good-c")
    socks = [client(b.control), client(b.control, curve=another_broker),
             client(f"tcp://127.0.0.1:{b.port + 1}", zmq.PUSH),  # plain on data in too: connecting is enough
             client(p.control, curve=mine)]  # and Curve against the plain broker
    for s in (socks[0], socks[1], socks[3]):
        try:
            s.send(_hello("producer", "x"))
        except zmq.Again:
            pass  # the handshake failed first: not even queued
    assert all(_silent(s, 1.0) for s in (socks[0], socks[1], socks[3]))
    ev = b.wait_event("broker.handshake_failed", 10, lambda e: e["socket"] == "control"
                      and e["error"] in ("mechanism_mismatch", "no_detail"))
    assert ev["curve"] is True and "--curve-keys" in ev["hint"]
    ev = b.wait_event("broker.handshake_failed", 10, lambda e: e["error"] == "cryptographic")
    assert ev["socket"] == "control" and "broker.key" in ev["hint"]
    # Which end notices a mismatch first is a race: the one that does hangs up (`no_detail` here)
    ev = b.wait_event("broker.handshake_failed", 10, lambda e: e["socket"] == "data_in")
    assert ev["error"] in ("mechanism_mismatch", "no_detail") and "--curve-keys" in ev["hint"]
    ev = p.wait_event("broker.handshake_failed", 10, lambda e: e["socket"] == "control")
    assert ev["curve"] is False and ev["error"] in ("mechanism_mismatch", "no_detail")
    assert "without --curve-keys" in ev["hint"]
    for s in socks:
        s.close()


class _Tap:
    """A TCP relay that keeps a copy of every byte going either way."""

    def __init__(self, target_port: int):
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port, self.target, self.seen = self.srv.getsockname()[1], target_port, bytearray()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            a, _ = self.srv.accept()
            z = socket.create_connection(("127.0.0.1", self.target))
            for src, dst in ((a, z), (z, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src, dst) -> None:
        while data := src.recv(65536):
            self.seen += data
            dst.sendall(data)


@pytest.mark.parametrize("on", [True, False], ids=["curve", "plain"])
def test_what_a_wire_tap_sees(curve_broker, brokers, keys, on):
    b = curve_broker() if on else brokers()
    tap = _Tap(b.port)
    st = curve_status(f"tcp://127.0.0.1:{tap.port}", keys if on else None, "good-c" if on else None, 5.0)
    assert st is not None and st["run_id"] == b.run_id
    # In clear the run ID and the message type cross the wire readably; with Curve neither does.
    readable = b.run_id.encode() in tap.seen or b"status_reply" in tap.seen
    assert readable is not on


def test_dflash_status_speaks_curve_with_an_authorised_key_only(curve_broker, keys):
    b = curve_broker()

    def status(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dflash.tools.status_command", "--broker", b.control, "--json",
                               "--timeout-s", "3", *extra], capture_output=True, text=True, timeout=60)

    ok = status("--curve-keys", str(keys), "--curve-name", "good-c")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["run_id"] == b.run_id
    for extra in ([], ["--curve-keys", str(keys), "--curve-name", "intruder"]):
        refused = status(*extra)  # plain TCP, or a key the broker does not know: no answer at all
        assert refused.returncode == 1 and "no answer" in refused.stderr, refused.stderr


def test_real_producer_and_consumer_train_over_curve_and_a_keyless_producer_is_refused(curve_broker, keys,
                                                                                      tmp_path):
    from dflash.tools.tiny import tiny_target
    import dflash.producers.sample_data as pkg

    rows = (Path(pkg.__file__).parent / "chats.jsonl").read_text().splitlines()[:24]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(rows) + "\n")
    target, runs = str(tiny_target()), str(tmp_path / "runs")
    b = curve_broker("--epochs", "1", "--consumers", "1")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}, "OMP_NUM_THREADS": "1"}

    def start(module: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", module, "--broker", b.control, "--runs-dir", runs, *args],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    produce = ["--device", "cpu", "--target", target, "--data", str(data), "--max-length", "512",
               "--token-budget", "2048"]
    keyless = start("dflash.producers.produce_command", *produce, "--instance", "nokey")
    procs = [start("dflash.producers.produce_command", *produce, "--instance", "p", "--curve-keys", str(keys),
                   "--curve-name", "good-p"),
             start("dflash.consumers.process.consume_command", "--target", target, "--block-size", "8", "--anchors", "32",
                   "--draft-layers", "1", "--instance", "c", "--curve-keys", str(keys), "--curve-name", "good-c")]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out[-3000:]
        assert len(committed(b.run_dir)) == 24
        # its hello never got an answer: plain TCP is refused (it gives up 30 s after its start-up,
        # which on a loaded host may end after the others' whole run)
        out = keyless.communicate(timeout=240)[0]
        assert keyless.returncode == 1 and "no answer from broker" in out, out[-2000:]
    finally:
        for p in procs + [keyless]:
            if p.poll() is None:
                p.kill()
