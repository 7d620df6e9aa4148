"""The whole pipeline, every role its own process on loopback: `dflash-broker --consumers 2
--epochs 2`, two CPU producers running a tiny real target over the bundled chats, two
CPU consumers training one drafter as two gloo ranks: elastic (torchft, the default for
`--consumers 2`) and a fixed torch.distributed group (`--no-elastic`).

Run once per module; each test checks one thing a user would notice: clean exits, every
(epoch, sample) trained exactly once and committed, a final checkpoint that loads, logs
that are JSON lines of this run with the field report's content, a falling loss.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from dflash.protocol.sockets import free_port_block as _free_port_block

pytestmark = pytest.mark.integration

N_ROWS = 120  # chats per epoch: enough steps for the loss to move, small enough for 2 cores
EPOCHS = 2
STEP_FIELDS = ("step", "loss", "acc", "streak", "lr", "noise", "tokens_per_s", "batches_per_s", "queue",
               "epoch", "eta_s")



def _start(name: str, module: str, args: list[str], out_dir: Path, env: dict) -> tuple[str, subprocess.Popen, Path]:
    out = out_dir / f"{name}.out"
    with open(out, "w") as f:  # a file, not a pipe: nobody has to drain it
        p = subprocess.Popen([sys.executable, "-m", module, *args], stdout=f, stderr=subprocess.STDOUT, env=env)
    return name, p, out


def _wait_all(procs, timeout_s: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    try:
        for _, p, _ in procs:
            p.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for _, p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return {name: p.returncode for name, p, _ in procs}


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module", params=["elastic", "no-elastic"])
def run(tmp_path_factory, request):
    """Run the pipeline to the end; returns (run folder, exit codes, wall seconds)."""
    from dflash.tools.tiny import tiny_target

    import dflash.producers.sample_data as sample_data

    tmp = tmp_path_factory.mktemp("e2e")
    chats = (Path(sample_data.__file__).parent / "chats.jsonl").read_text().splitlines()[:N_ROWS]
    data = tmp / "chats.jsonl"
    data.write_text("\n".join(chats) + "\n")
    target, runs = str(tiny_target()), str(tmp / "runs")
    base = _free_port_block(6)
    broker = f"tcp://127.0.0.1:{base}"
    # One torch thread per process: five processes share two cores. No DFLASH_* from the
    # developer's shell: every option is on the command line.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(OMP_NUM_THREADS="1", DFLASH_LOG_JSON="1")
    t0 = time.monotonic()
    procs = [_start("broker", "dflash.broker.broker_command", [
        "--bind", "127.0.0.1", "--port", str(base), "--data-in-port", str(base + 1),
        "--data-out-ports", f"{base + 2}-{base + 5}", "--runs-dir", runs, "--epochs", str(EPOCHS),
        "--consumers", "2", f"--{request.param}", "--heartbeat-s", "0.5", "--timeout-s", "30", "--lease-size", "8"],
        tmp, env)]
    for i in range(2):
        procs.append(_start(f"producer-{i}", "dflash.producers.produce_command", [
            "--broker", broker, "--runs-dir", runs, "--instance", f"p{i}", "--device", "cpu", "--target", target,
            "--data", str(data), "--token-budget", "256", "--max-length", "256", "--max-batch-size", "2",
            "--lease-size", "8", "--prefetch", "2"], tmp, env))
    for i in range(2):
        procs.append(_start(f"consumer-{i}", "dflash.consumers.process.consume_command", [
            "--broker", broker, "--runs-dir", runs, "--instance", f"c{i}", "--target", target,
            "--block-size", "4", "--anchors", "16", "--draft-layers", "1", "--lr", "3e-3", "--save-every", "20",
            "--keep", "2", "--log-position-every", "20"], tmp, env))
    codes = _wait_all(procs, timeout_s=240)
    wall = time.monotonic() - t0
    if any(codes.values()):
        tails = {name: out.read_text()[-1500:] for name, _, out in procs if codes[name]}
        pytest.fail(f"exit codes {codes}; output of the failed: {tails}")
    (run_dir,) = [p for p in Path(runs).iterdir() if p.name != "latest"]
    print(f"pipeline ({request.param}) wall time {wall:.1f}s")
    return run_dir, codes, wall


def _consumer_logs(run_dir: Path) -> dict[int, list[dict]]:
    """rank -> that consumer's events."""
    out = {}
    for f in (run_dir / "logs").glob("consumer-*.jsonl"):
        ev = _events(f)
        rank = next(e["rank"] for e in ev if e["event"] == "train.start")
        out[rank] = ev
    return out


def test_every_process_exits_0(run):
    _, codes, _ = run
    assert codes == {"broker": 0, "producer-0": 0, "producer-1": 0, "consumer-0": 0, "consumer-1": 0}


def test_every_epoch_sample_is_trained_exactly_once_and_committed(run):
    run_dir, _, _ = run
    db = sqlite3.connect(run_dir / "ledger.sqlite")
    rows = db.execute("SELECT epoch, sample, state, batch_id FROM samples").fetchall()
    assert sorted((e, s) for e, s, _, _ in rows) == [(e, s) for e in range(EPOCHS) for s in range(N_ROWS)]
    assert {state for _, _, state, _ in rows} == {"committed"}
    batches = {b: (n, d, state) for b, n, d, state in
               db.execute("SELECT batch_id, n_samples, deliveries, state FROM batches")}
    per_batch = Counter(b for *_, b in rows)
    assert set(per_batch) == set(batches)
    assert all(batches[b] == (n, 1, "committed") for b, n in per_batch.items())  # delivered once, trained once
    # The consumers' own count (summed over both ranks) agrees: nothing trained twice.
    ends = [next(e for e in ev if e["event"] == "consume.done") for ev in _consumer_logs(run_dir).values()]
    assert [e["samples"] for e in ends] == [EPOCHS * N_ROWS] * 2
    assert ends[0]["step"] == ends[1]["step"]
    last_commit = db.execute("SELECT step, checkpoint FROM commits ORDER BY rowid DESC LIMIT 1").fetchone()
    assert last_commit[0] == ends[0]["step"] and last_commit[1].endswith(f"step-{ends[0]['step']}")


def test_final_checkpoint_exists_and_loads(run):
    import torch

    from dflash.consumers.checkpoints.checkpoint import load_checkpoint
    from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig
    from dflash.runtime.target_heads import load_target_heads
    from dflash.tools.tiny import tiny_target

    run_dir, _, _ = run
    done = next(e for e in _consumer_logs(run_dir)[0] if e["event"] == "consume.done")
    path = run_dir / "checkpoints" / f"step-{done['step']}"
    assert Path(done["last_checkpoint"]).resolve() == path.resolve()
    heads = load_target_heads(tiny_target(), dtype=torch.float32)
    state = json.loads((path / "state.json").read_text())
    model = DFlashDraft(DrafterConfig.from_target(heads.spec, 1, len(state["signal"]["target_layers"])))
    saved, rng = load_checkpoint(path, model, torch.optim.AdamW(model.parameters()))
    assert saved["step"] == done["step"] and saved["samples"] == EPOCHS * N_ROWS and len(rng) == 2
    assert saved["signal"]["block_size"] == 4 and saved["signal"]["anchors"] == 16


def test_logs_are_json_lines_of_this_run_with_the_field_report(run):
    run_dir, _, _ = run
    files = sorted(p.name for p in (run_dir / "logs").glob("*.jsonl"))
    assert files == ["broker-main.jsonl", "consumer-c0.jsonl", "consumer-c1.jsonl", "producer-p0.jsonl",
                     "producer-p1.jsonl"]
    for f in (run_dir / "logs").glob("*.jsonl"):
        assert {e["run_id"] for e in _events(f)} == {run_dir.name}, f.name
    logs = _consumer_logs(run_dir)
    assert sorted(logs) == [0, 1]
    for rank, ev in logs.items():
        steps = [e for e in ev if e["event"] == "train.step"]
        assert steps and all(k in e for e in steps for k in STEP_FIELDS), rank
        assert all(e["rank"] == rank for e in steps)
        # The broker's figures reached the line: q_pre per producer (empty once producers left,
        # which happens before the first step when consumers start late), the shared queue, progress.
        producers = {e["peer"] for e in _events(run_dir / "logs" / "broker-main.jsonl")
                     if e["event"] == "broker.peer_joined" and e["peer_role"] == "producer"}
        for e in steps:
            q = e["queue"]
            assert isinstance(q["q_pre"], dict) and set(q["q_pre"]) <= producers, (rank, q)
            assert isinstance(q["q_hs"], int) and q["q_hs"] >= 0, (rank, q)
        assert any(e["queue"]["q_pre"] or e["queue"]["q_hs"] for e in steps), rank
        assert 1.0 < max(e["epoch"] for e in steps) <= EPOCHS
        assert any(e["eta_s"] is not None for e in steps)


def test_loss_at_the_end_is_below_the_start(run):
    run_dir, _, _ = run
    losses = [e["loss"] for e in _consumer_logs(run_dir)[0] if e["event"] == "train.step" and e["loss"] is not None]
    assert len(losses) >= 10
    # The tiny drafter's loss falls in a few steps, then sits on a plateau that moves about
    # 0.1 step to step: the last ten steps' mean, not the last three's, says where it ended.
    assert sum(losses[-10:]) / 10 < sum(losses[:3]) / 3 - 0.1, losses


def test_the_consumers_formed_the_group_asked_for(run, request):
    """--elastic (default): each consumer joins the broker's torchft lighthouse; --no-elastic:
    a fixed torch.distributed group, and no lighthouse runs."""
    run_dir = run[0]
    elastic = request.node.callspec.params["run"] == "elastic"
    logs = _consumer_logs(run_dir)
    broker = [e["event"] for f in (run_dir / "logs").glob("broker-*.jsonl") for e in _events(f)]
    assert sorted(logs) == [0, 1]
    for ev in logs.values():
        names = {e["event"] for e in ev}
        assert ("consume.elastic_join" in names) == elastic and ("consume.dist_join" in names) == (not elastic)
        assert next(e for e in ev if e["event"] == "train.start")["elastic"] == elastic
    assert ("broker.lighthouse" in broker) == elastic
