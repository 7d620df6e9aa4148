"""dflash-status against a live pipeline: a real broker process, stats-reporting wire
fakes as processes, real sockets. A lagging drafter makes the diagnosis name the drafters,
a slow target names the targets, and a SIGKILLed drafter shows as lost within the
heartbeat timeout with its last step."""

from __future__ import annotations

import json
import re
import signal
import time
from datetime import datetime

from tests.harness.broker import ask_status
from tests.status.helpers import rows, status, status_json
from tests.harness.wait import wait_for
import pytest

pytestmark = pytest.mark.integration

TIMEOUT_S = 1.5  # the harness starts brokers with --heartbeat-s 0.2 --timeout-s 1.5
GiB = 1 << 30


def check_every_field(st: dict, run_id: str) -> None:
    """Every figure issue 6 lists, in the --json map, with live values."""
    assert st["run_id"] == run_id and st["broker"]["started_at"].endswith("Z")
    p = st["progress"]
    assert p["epoch"] == 0 and p["epochs"] == 1 and p["total"] == 5000
    assert 0 < p["committed"] <= p["trained"] <= p["total"] and 0 < p["epochs_done"] < 1
    assert p["samples_per_s"] > 0 and p["eta_s"] > 0 and p["eta_at"].endswith("Z")
    q = st["queue"]
    assert {"batches", "bytes", "oldest_age_s", "capacity_bytes", "full_frac"} <= set(q)
    (prod,) = rows(st, "producer").values()
    assert prod["host"] and prod["gpu"] == 0 and prod["state"] == "producing" and prod["tokens_per_s"] > 0
    assert prod["q_pre"] == 2 and prod["in_flight"] >= 0 and 0 <= prod["heartbeat_age_s"] < TIMEOUT_S
    assert prod["gpu_mem_used"] == int(61.5 * GiB) and prod["gpu_mem_total"] == 96 * GiB and prod["gpu_util"] == 90
    for name, c in rows(st, "consumer").items():
        assert c["rank"] in (0, 1) and c["step"] > 0 and c["tokens_per_s"] > 0, (name, c)
        assert c["loss"] > 0 and 0 <= c["acc"] <= 1 and c["streak"] >= 0 and c["credit"] >= 0
        assert c["in_flight"] >= 0 and 0 <= c["heartbeat_age_s"] < TIMEOUT_S and 0 <= c["wait_frac"] <= 1
        assert c["gpu_mem_used"] == int(70.25 * GiB) and c["gpu_mem_total"] == 96 * GiB and c["gpu_util"] == 90
    assert set(st["diagnosis"]) == {"code", "text", "suggestion", "limited_by"}


def test_lagging_drafter_names_the_drafters_and_every_field_is_there(start_broker, fakes):
    # A small queue fills fast: one quick target, one quick drafter, one drafter 10x slower.
    b = start_broker("--queue-bytes", "2KiB", "--consumers", "2", "--progress-s", "1")
    fakes("producer", b, "--instance", "tgt0", "--gpu", "0", "--delay-s", "0.01")
    fakes("consumer", b, "--instance", "dft5", "--gpu", "5", "--train-s", "0.05")
    fakes("consumer", b, "--instance", "dft6", "--gpu", "6", "--train-s", "0.5")

    def ready(st):
        cons = rows(st, "consumer")
        return (st["diagnosis"]["code"] == "targets_backed_up" and "dft6" in st["diagnosis"]["text"]
                and st["progress"]["committed"] > 0 and len(cons) == 2 and all(c["step"] for c in cons.values()))

    wait_for(lambda: ask_status(b.control), ready, 25)
    st = status_json("--broker", b.control)  # the CLI's --json, as a script would read it
    check_every_field(st, b.run_id)
    d = st["diagnosis"]
    assert d["code"] == "targets_backed_up" and d["limited_by"] == "drafters", d
    assert d["text"].startswith("drafters limit throughput: targets backed up, queue full")
    assert re.search(r"slowest drafter c\d \(dft6\) at", d["text"]), d["text"]  # IDs follow join order
    # the diagnosis' grounds (diagnosis.py): targets blocked on send a quarter of the window, or the
    # queue full right now (on a loaded host the share can sit just under a quarter when this is read)
    assert st["queue"]["full_frac"] >= 0.25 or st["queue"]["reading"] is False, st["queue"]
    # one target feeding two drafters cannot give one up: the suggestion is to add drafters
    assert d["suggestion"].startswith("add drafter GPUs")

    human = status("--broker", b.control)
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    assert lines[0].startswith(f"run {b.run_id}  started ") and "LIVE" in lines[0]
    assert lines[1].startswith("progress epoch 1/1") and "ETA" in lines[1] and "committed" in lines[1]
    assert "why      drafters limit throughput" in human.stdout and "-> add drafter GPUs" in human.stdout
    table = {ln.split()[2]: ln for ln in lines if ln.startswith(("producer ", "consumer "))}
    assert "61.5/96.0G" in table["tgt0"] and "90%" in table["tgt0"] and "smp" in table["tgt0"]
    rank = rows(st, "consumer")["dft6"]["rank"]  # ranks follow join order
    assert table["dft6"].split()[3] == str(rank) and "70.2/96.0G" in table["dft6"]

    # the logs keep the history: when the limit changed, and the pace with each progress line
    changed = b.wait_event("broker.diagnosis", 5, lambda e: e["code"] == "targets_backed_up")
    assert changed["level"] == "warning" and changed["limited_by"] == "drafters" and changed["suggestion"]
    progress = b.wait_event("broker.progress", 5, lambda e: e["diagnosis"] == "targets_backed_up")
    assert progress["samples_per_s"] > 0 and progress["eta_s"] > 0


def test_slow_target_names_the_targets_and_suggests_moving_a_drafter_gpu(start_broker, fakes):
    b = start_broker("--consumers", "2")
    fakes("producer", b, "--instance", "tgt0", "--gpu", "0", "--delay-s", "0.25")
    fakes("consumer", b, "--instance", "dft5", "--gpu", "5", "--train-s", "0.01")
    fakes("consumer", b, "--instance", "dft6", "--gpu", "6", "--train-s", "0.01")
    # past the first seconds, when the rate windows hold a few batches of each side
    wait_for(lambda: ask_status(b.control), lambda st: st["diagnosis"]["code"] == "drafters_starved"
             and st["broker"]["uptime_s"] > 4, 25)
    st = status_json("--broker", b.control)
    d = st["diagnosis"]
    assert d["code"] == "drafters_starved" and d["limited_by"] == "targets", d
    assert d["text"].startswith("targets limit throughput: drafters starved")
    assert st["queue"]["batches"] <= 1 and all(c["wait_frac"] > 0.5 for c in rows(st, "consumer").values())
    # drafters wait most of the time: one of them is worth more as a target
    assert d["suggestion"].startswith("move 1 GPU from drafters to targets"), d


def test_killed_drafter_shows_lost_within_the_timeout_with_its_last_step(start_broker, fakes):
    b = start_broker()
    fakes("producer", b, "--instance", "tgt0", "--gpu", "0", "--delay-s", "0.02")
    fakes("consumer", b, "--instance", "dft5", "--gpu", "5", "--train-s", "0.05")
    victim = fakes("consumer", b, "--instance", "dft6", "--gpu", "6", "--train-s", "0.3")
    before = wait_for(lambda: ask_status(b.control),
                      lambda st: ((rows(st, "consumer").get("dft6") or {}).get("step") or 0) >= 3, 20)
    victim.send_signal(signal.SIGKILL)
    t_kill = time.time()
    victim.wait(5)
    st = wait_for(lambda: ask_status(b.control, 1.0),
                  lambda st: any(g["instance"] == "dft6" for g in st["gone"]), 10, every_s=0.05)
    (g,) = [g for g in st["gone"] if g["instance"] == "dft6"]
    at = datetime.fromisoformat(g["at"].replace("Z", "+00:00")).timestamp()
    assert g["state"] == "lost" and "silent for" in g["reason"]
    assert TIMEOUT_S - 0.5 <= at - t_kill <= TIMEOUT_S + 0.6, at - t_kill  # the broker loop ticks every 0.1 s
    logged = [json.loads(x)["step"] for x in (b.run_dir / "logs" / "consumer-dft6.jsonl").read_text().splitlines()
              if '"train.step"' in x]
    assert g["last_step"] >= rows(before, "consumer")["dft6"]["step"]
    assert g["last_step"] in (logged[-1], logged[-1] - 1)  # its last heartbeat may predate its last step
    assert "dft6" not in rows(st, "consumer")
    d = st["diagnosis"]
    assert d["code"] == "peer_lost" and f"last step {g['last_step']}" in d["text"] and "(dft6) lost" in d["text"]

    human = status("--broker", b.control).stdout
    (line,) = [ln for ln in human.splitlines() if ln.startswith("consumer ") and " dft6 " in ln]
    assert " lost " in line and "silent for" in line and f"last step {g['last_step']}" in line
