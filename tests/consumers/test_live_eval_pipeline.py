"""`dflash-consume --eval-every N` on a real pipeline: a broker, a CPU producer running a
tiny real target over the bundled chats with --regenerate, and a consumer, each its own
process on loopback. The consumer logs `eval.step` (simulated acceptance on the batch about to be
trained), `eval.tau` (real speculative decoding of the whole target on --eval-prompts,
lossless) and `eval.cost`; `dflash-status --json` on the live run shows the latest figures,
and the human view an EVAL row. bench/tau_curve.py turns the run's logs into tau against
samples trained (PNG and JSON).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.protocol.sockets import free_port_block
from dflash.tools.procs import ProcessGroup

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

N_ROWS, EPOCHS, EVERY, B, PROMPTS, NEW, REGEN_NEW = 48, 2, 4, 4, 3, 16, 24


def _status(broker: str) -> dict | None:
    r = subprocess.run([sys.executable, "-m", "dflash.tools.status_command", "--broker", broker, "--json", "--timeout-s", "2"],
                       capture_output=True, text=True, timeout=30)
    return json.loads(r.stdout) if r.returncode == 0 else None


def _consumer_eval(st: dict | None) -> dict | None:
    rows = [p for p in (st or {}).get("peers", []) if p["role"] == "consumer"]
    return rows[0].get("eval") if rows else None


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """Run the pipeline to its end, catching `dflash-status` (--json and text) once the
    consumer reported an evaluation. Returns (consumer events, status map, status text,
    producer events, run folder)."""
    from dflash.tools.tiny import tiny_target

    import dflash.producers.sample_data as sample_data

    tmp = tmp_path_factory.mktemp("live_eval")
    chats = (Path(sample_data.__file__).parent / "chats.jsonl").read_text().splitlines()
    (tmp / "chats.jsonl").write_text("\n".join(chats[:N_ROWS]) + "\n")
    (tmp / "prompts.jsonl").write_text("\n".join(chats[N_ROWS:N_ROWS + PROMPTS]) + "\n")  # not trained on
    target, runs = str(tiny_target()), str(tmp / "runs")
    base = free_port_block(4)
    broker = f"tcp://127.0.0.1:{base}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(OMP_NUM_THREADS="1", DFLASH_LOG_JSON="1")
    py = [sys.executable, "-m"]
    group = ProcessGroup()
    group.start("broker", py + ["dflash.broker.broker_command", "--bind", "127.0.0.1", "--port", str(base), "--data-in-port",
                                str(base + 1), "--data-out-ports", f"{base + 2}-{base + 3}", "--runs-dir", runs,
                                "--epochs", str(EPOCHS), "--heartbeat-s", "0.5", "--timeout-s", "30",
                                "--lease-size", "8"], tmp / "broker.out", env)
    group.start("producer", py + ["dflash.producers.produce_command", "--broker", broker, "--runs-dir", runs, "--instance", "p0",
                                  "--device", "cpu", "--target", target, "--data", str(tmp / "chats.jsonl"),
                                  "--token-budget", "256", "--max-length", "256", "--max-batch-size", "2",
                                  "--lease-size", "8", "--prefetch", "2", "--regenerate", "--max-new-tokens",
                                  str(REGEN_NEW), "--regen-cache", str(tmp / "regen")], tmp / "producer.out", env)
    group.start("consumer", py + ["dflash.consumers.process.consume_command", "--broker", broker, "--runs-dir", runs, "--instance", "c0",
                                  "--target", target, "--block-size", str(B), "--anchors", "16", "--draft-layers",
                                  "1", "--lr", "3e-3", "--save-every", "0", "--eval-every", str(EVERY),
                                  "--eval-prompts", str(tmp / "prompts.jsonl"), "--eval-max-new-tokens", str(NEW)],
                tmp / "consumer.out", env)
    st = text = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not group.all_exited() and not group.failed():
            st = _status(broker)
            if (_consumer_eval(st) or {}).get("step"):
                # the text view is a second query: on a loaded host it may time out, so ask again
                text = subprocess.run([sys.executable, "-m", "dflash.tools.status_command", "--broker", broker],
                                      capture_output=True, text=True, timeout=30).stdout
                if any(ln.startswith("eval ") for ln in text.splitlines()):
                    break
            time.sleep(0.3)
        while time.monotonic() < deadline and not group.all_exited() and not group.failed():
            time.sleep(0.3)
    finally:
        failed = group.failed() or [c for c in group.children if c.alive()]
        group.stop(grace_s=10)
    if failed:
        pytest.fail("; ".join(f"{c.name} rc={c.proc.returncode}: {c.out_path.read_text()[-1500:]}" for c in failed))
    (run_dir,) = [p for p in Path(runs).iterdir() if p.name != "latest"]
    (log,) = (run_dir / "logs").glob("consumer-*.jsonl")
    (plog,) = (run_dir / "logs").glob("producer-*.jsonl")
    producer = [json.loads(x) for x in plog.read_text().splitlines()]
    return [json.loads(x) for x in log.read_text().splitlines()], st, text, producer, run_dir


def test_eval_events_every_n_steps_with_sane_figures(live_run):
    events, *_ = live_run
    done = next(e for e in events if e["event"] == "consume.done")
    sims = [e for e in events if e["event"] == "eval.step"]
    taus = [e for e in events if e["event"] == "eval.tau"]
    costs = [e for e in events if e["event"] == "eval.cost"]
    # Every EVERY steps, before the next step trains; the finished weights get a real tau.
    assert [e["step"] for e in sims] == list(range(EVERY, done["step"], EVERY))
    assert [e["step"] for e in taus] == [e["step"] for e in sims] + [done["step"]]
    assert [e["step"] for e in costs] == [e["step"] for e in taus]
    for e in sims:
        assert 0 <= e["acc"] <= 1 and 1 <= e["tau"] <= B and e["loss"] > 0 and e["blocks"] > 0
        assert len(e["acc_by_position"]) == B - 1 and e["sequences"] >= 1
        # the batch about to be trained: never trained in epoch 0; a later epoch's samples were
        assert e["unseen_frac"] == (1.0 if e["epoch"] == 0 else 0.0), e
    for e in taus:
        assert e["prompts"] == PROMPTS and e["new_tokens"] == PROMPTS * NEW and e["mismatches"] == []
        assert 1 <= e["tau"] <= B and e["drafted"] > 0 and 0 <= e["accepted"] <= e["drafted"]
        assert sum(e["tau_hist"]) == e["cycles"] and e["speedup"] > 0
    start = next(e for e in events if e["event"] == "eval.start")
    assert start["every"] == EVERY and start["prompts"] == PROMPTS and start["target_tokens"] == PROMPTS * NEW
    assert all(c["seconds"] > 0 for c in costs) and all(0 < c["overhead_frac"] < 1 for c in costs[1:])
    print(f"\neval cost per evaluation: {[c['seconds'] for c in costs]} s, "
          f"share of wall time: {[c['overhead_frac'] for c in costs]}")


def test_status_json_and_view_show_the_latest_eval(live_run):
    events, st, text, *_ = live_run
    ev = _consumer_eval(st)
    assert ev is not None, f"no eval in the live status: {json.dumps(st)[:2000]}"
    sim = next(e for e in events if e["event"] == "eval.step" and e["step"] == ev["step"])
    real = next(e for e in events if e["event"] == "eval.tau" and e["step"] == ev["step"])
    assert (ev["sim_tau"], ev["sim_acc"], ev["sim_loss"], ev["unseen_frac"]) == (
        sim["tau"], sim["acc"], sim["loss"], sim["unseen_frac"])
    assert (ev["tau"], ev["tau_pooled"], ev["speedup"], ev["prompts"], ev["mismatches"]) == (
        real["tau"], real["tau_pooled"], real["speedup"], PROMPTS, 0)
    assert ev["seconds"] > 0 and ev["at"] <= time.time()
    print("\n" + "\n".join(ln for ln in text.splitlines() if ln.startswith(("EVAL", "eval "))))
    row = next(ln for ln in text.splitlines() if ln.startswith("eval "))
    cols = row.split()  # taken a moment later than the JSON: maybe a later evaluation's
    assert cols[1].startswith("c") and cols[2] == "c0" and int(cols[3]) >= ev["step"]
    sim = next(e for e in events if e["event"] == "eval.step" and e["step"] == int(cols[3]))
    real = next(e for e in events if e["event"] == "eval.tau" and e["step"] == int(cols[3]))
    assert f"{sim['tau']:.2f}" == cols[5] and f"{real['tau']:.2f}" == cols[8] and cols[12] == f"{PROMPTS}/{PROMPTS}"


def test_the_producer_regenerates_once_and_reads_the_cache_in_epoch_2(live_run):
    producer = live_run[3]
    regen = [e for e in producer if e["event"] == "produce.regen"]
    assert sum(e["generated"] for e in regen) == N_ROWS  # each chat generated once, in epoch 1
    assert sum(e["cached"] for e in regen) == N_ROWS * (EPOCHS - 1)  # and read back after
    assert all(e["rows"] == e["generated"] + e["cached"] and (e["new_tokens"] > 0) == (e["generated"] > 0)
               for e in regen)


def test_tau_against_samples_trained_from_the_runs_logs(live_run, tmp_path):
    events, *_, run_dir = live_run
    taus = [e for e in events if e["event"] == "eval.tau"]
    # Every evaluation says how many samples its weights trained: one step trains a batch of 1
    # or 2 sequences (--max-batch-size 2), and the last one, the finished weights, all of them.
    assert all(e["step"] <= e["samples"] <= 2 * e["step"] for e in taus)
    assert [e["samples"] for e in taus] == sorted({e["samples"] for e in taus})
    assert taus[-1]["samples"] == next(e for e in events if e["event"] == "consume.done")["samples"] == N_ROWS * EPOCHS
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "tau_curve.py"), "--run", f"tiny={run_dir}",
                        "--out", str(tmp_path / "tau.png")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "tau.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curve = json.loads((tmp_path / "tau.json").read_text())["tiny"]
    assert [(p["step"], p["samples"], p["tau"]) for p in curve["tau"]] == [(e["step"], e["samples"], e["tau"])
                                                                          for e in taus]
    assert len(curve["tau"]) >= 4 and all(p["mismatches"] == 0 for p in curve["tau"])
    sims = [e for e in events if e["event"] == "eval.step"]
    assert [(p["samples"], p["tau"]) for p in curve["simulated"]] == [(e["samples"], e["tau"]) for e in sims]
    # A run without --eval-prompts has no curve: a named error, not an empty plot.
    bare = tmp_path / "bare"
    (bare / "logs").mkdir(parents=True)
    (bare / "logs" / "consumer-c0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events
                                                             if e["event"] != "eval.tau"))
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "tau_curve.py"), "--run", str(bare),
                        "--out", str(tmp_path / "bare.png")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "no eval.tau events" in r.stderr and not (tmp_path / "bare.png").exists()
