"""bench/gpu_one_gpu.sh, the scripted GPU session of the README's one-GPU path, run end to end
on CPU with the real small target as the GPU session takes it (its .gguf file), so that the three calls a GPU window is spent on cannot rot:
`step` builds the baseline tree apart and imports each tree's own code; `start` writes prompts
with the target and trains under a time budget; `finish` exports, measures tau on held-out and
training prompts, and reads the logs into one report. The figures are CPU's and meaningless;
what is checked is that every stage ran and the report says what the issue asks."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from dflash.tools import real_target

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_one_gpu.sh"
# Short form: the bundled chats' first requests stand for the prompts (dflash-prompts has its own
# tests, and writing even a few takes minutes on CPU); DFLASH_LONG=1 has the target write them.
LONG = os.environ.get("DFLASH_LONG") == "1"
BUDGET = 420 if LONG else 75
pytestmark = pytest.mark.timeout(BUDGET + 900)  # the run, then export and two evaluations on CPU


def bundled_prompts(folder: Path) -> Path:
    """prompts.jsonl and prompts.holdout.jsonl as dflash-prompts writes them, from the bundled chats."""
    import dflash.producers.sample_data as pkg

    rows = (Path(pkg.__file__).parent / "chats.jsonl").read_text().splitlines()
    asks = [{"id": f"self-{i}", "messages": [next(m for m in json.loads(r)["messages"] if m["role"] == "user")]}
            for i, r in enumerate(rows[:40])]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in asks[:36]))
    (folder / "prompts.holdout.jsonl").write_text("".join(json.dumps(a) + "\n" for a in asks[36:]))
    return folder / "prompts.jsonl"


def _run(part: str, env: dict, timeout: int) -> subprocess.CompletedProcess:
    r = subprocess.run(["bash", str(SCRIPT), part], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{part} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    work = tmp_path_factory.mktemp("onegpu")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_") and k not in ("W", "OUT", "TARGET")}
    # W, OUT and TARGET are the script's own, as in a GPU call: W under TMPDIR, the target where gpu_join
    # leaves it (an unexported W once sent the background run to /run)
    w = work / "dflash-onegpu"
    w.mkdir()
    (w / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(real_target.fetch_gguf())
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", GPU="-1", TMPDIR=str(work),
        BUDGET=str(BUDGET), COUNT="7", HOLDOUT="1", EPOCHS="50", OMP_NUM_THREADS="1", START_WAIT_S="600",
        PROMPT_ARGS="--max-new-tokens 48 --answer-tokens 32 --batch-size 16 --exclude riddle",
        PRODUCER_ARGS="--max-new-tokens 24",
        # live evaluation of the held-out prompts, as a tau-curve run takes it
        CONSUMER_ARGS=f"--draft-layers 1 --save-every 4 --eval-every 3 --eval-prompts {w}/run/prompts.holdout.jsonl "
                      "--eval-limit 1 --eval-max-new-tokens 4",
        REPORT_ARGS="--indist 3 --max-new-tokens 16",
    )
    if not LONG:
        env["PROMPTS_FROM"] = str(bundled_prompts(work))
    start = _run("start", env, BUDGET + 400)
    finish = _run("finish", env, 900)
    return w, start, finish, env


@pytest.mark.real_target
@pytest.mark.integration
def test_the_budget_run_ends_by_itself_within_its_budget_and_annealed(session):
    work, _, _, _ = session
    result = json.loads((work / "out" / "result.json").read_text())
    run = result["run"]
    assert f"--regen-cache {work}/regen" in " ".join(run["args"]["producer"]), run["args"]
    assert run["exit_codes"] == {"broker": 0, "producer": 0, "consumer": 0}, run
    assert not run["timed_out"]
    assert run["train_budget_s"] <= BUDGET and (run["prompts_s"] > 0 or not LONG)
    assert result["checks"]["within_budget"], (run["total_s"], BUDGET)
    logs = result["logs"]
    assert logs["steps"] > 0 and logs["plans"], logs
    # About ten steps on CPU: the last one's lr is what one step's share of the schedule leaves,
    # not the GPU report's 1% of the peak; the plan was trained to its end, nothing un-annealed.
    assert logs["end"]["reason"] == "end_of_stream" and not logs["unannealed"], logs["end"]
    assert logs["lr_last"] <= 2 * logs["lr_max"] / logs["steps"], (logs["lr_last"], logs["lr_max"], logs["steps"])
    states = result["ledger"]["samples_by_state"]
    assert states.get("committed", 0) == logs["samples"], (states, logs["samples"])  # every sample trained, committed
    assert "trained" not in states


@pytest.mark.real_target
@pytest.mark.integration
def test_the_report_measures_held_out_and_training_prompts_and_the_regeneration(session):
    work, _, finish, _ = session
    result = json.loads((work / "out" / "result.json").read_text())
    for part in ("heldout", "indist"):
        ev = result[part]
        assert ev["exit_code"] == 0, ev
        assert ev["tau"] >= 1.0 and ev["prompts"] >= 1, ev
        # tau apart for answers the target ran to the cap (loops among them) and for those it ended
        assert ev["capped"]["prompts"] + ev["ended"]["prompts"] == ev["prompts"], ev
        assert all(1.0 <= (ev[k]["tau"] or 1.0) for k in ("capped", "ended")), ev
        assert sum(1 for _ in ev["tau_by_family"]) >= 1, ev
    assert result["logs"]["regen_rows"], "the producer logged no regeneration rows"
    assert set(result["checks"]) >= {"heldout_tau", "heldout_speedup", "indist_tau", "wait_after_first_minute"}
    with tarfile.open(work / "out" / "logs.tgz") as t:
        assert {"broker.out", "producer.out", "consumer.out", "run.json"} <= set(t.getnames())
    assert '"checks"' in finish.stdout
    curve = json.loads((work / "out" / "tau_curve.json").read_text())  # the live evaluation's points
    points = next(iter(curve.values()))["tau"]
    assert points and all(p["tau"] >= 1.0 and p["samples"] > 0 for p in points), curve
    assert (work / "out" / "tau_curve.png").stat().st_size > 0


@pytest.mark.real_target
@pytest.mark.integration
def test_the_step_call_builds_the_baseline_apart_from_this_tree(tmp_path):
    # the baseline tree: this checkout's own files as `git archive` packs them
    tar = tmp_path / "baseline.tar"
    tar.write_bytes(subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", GPU="-1",
               W=str(tmp_path / "w"), OUT=str(tmp_path / "out"), BASELINE_TAR=str(tar))
    _run("step", env, 300)
    before = json.loads((tmp_path / "out" / "step_before.json").read_text())
    after = json.loads((tmp_path / "out" / "step_after.json").read_text())
    assert before["train"].startswith(str(tmp_path / "w" / "base_site")), before
    assert after["train"].startswith(str(ROOT)), after


@pytest.mark.real_target
@pytest.mark.integration
def test_finish_packs_the_answers_and_a_sweep_call_trains_on_them(session, tmp_path):
    work, _, _, env = session
    with tarfile.open(work / "out" / "sweep_data.tgz") as t:
        t.extractall(tmp_path, filter="data")
    data = tmp_path / "sweep_data"
    assert {p.name for p in data.iterdir()} == {"train.jsonl", "indist.jsonl", "heldout.jsonl", "regen.sqlite"}
    db = sqlite3.connect(data / "regen.sqlite")
    rows = db.execute("SELECT COUNT(*), SUM(LENGTH(input_ids)), MAX(messages) FROM regen_ids").fetchone()
    prompts = len((data / "train.jsonl").read_text().splitlines())
    assert rows[0] == prompts and rows[1] > 0 and rows[2] == "[]", (rows, prompts)  # every answer, no chat text
    # a later session's call: only the packed answers, no run before it
    sweep_env = {**env, "SWEEP": "draft_layers=1", "SWEEP_SAMPLES": "4", "SWEEP_DATA": str(work / "out" / "sweep_data.tgz"),
                 "SWEEP_ARGS": "--val 2 --eval-prompts 1 --max-new-tokens 4"}
    _run("sweep", sweep_env, 900)
    _check_sweep(work / "out", "draft_layers=1")


def _check_sweep(out: Path, config: str) -> None:
    rows = json.loads((out / "sweep.json").read_text())["results"]
    assert [r["config"] for r in rows] == [config] and rows[0]["samples"] > 0, rows
    assert rows[0]["heldout"]["tau"] >= 1.0, rows[0]
    assert config in (out / "sweep.log").read_text()


@pytest.mark.real_target
@pytest.mark.integration
def test_a_sweep_call_without_carried_answers_makes_its_own(tmp_path):
    # a session whose earlier run left nothing: the target answers the prompts first (bench/regen_data.py)
    w = tmp_path / "dflash-onegpu"
    w.mkdir()
    (w / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(real_target.fetch_gguf())
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_") and k not in ("W", "OUT", "TARGET")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", GPU="-1", TMPDIR=str(tmp_path),
               OMP_NUM_THREADS="1", PROMPTS_FROM=str(bundled_prompts(tmp_path)), SWEEP_DATA=str(tmp_path / "none.tgz"),
               REGEN_ARGS="--limit 8 --max-new-tokens 24", SWEEP="anchor_every=2", SWEEP_SAMPLES="4",
               SWEEP_ARGS="--val 2 --eval-prompts 1 --max-new-tokens 4")
    _run("sweep", env, 900)
    out = w / "out"
    with tarfile.open(out / "sweep_data.tgz") as t:
        assert {"sweep_data/regen.sqlite", "sweep_data/heldout.jsonl", "sweep_data/indist.jsonl"} <= set(t.getnames())
    regen = json.loads((out / "regen.json").read_text())
    assert regen["rows"] == 8 and regen["generated"] == 8 and regen["new_tokens"] > 0, regen
    _check_sweep(out, "anchor_every=2")
