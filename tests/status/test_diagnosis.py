"""diagnose() on hand-written status maps: each check fires on the situation it names, in
the order of urgency, and the GPU-move suggestion is the arithmetic the docs promise."""

from __future__ import annotations

import copy

import pytest

from dflash.broker.diagnosis import best_move, diagnose

pytestmark = pytest.mark.integration

K = 1000.0


def producer(i: int, tps: float, **kw) -> dict:
    return {"peer": f"p{i}", "role": "producer", "instance": f"h-gpu{i}", "host": "h", "gpu": i, "state": "producing",
            "tokens_per_s": tps, "gpu_util": 90.0, "oom_backoff": False, "in_flight": 64, "stats": {}, **kw}


def consumer(i: int, tps: float, wait_frac: float = 0.0, **kw) -> dict:
    return {"peer": f"c{i}", "role": "consumer", "instance": f"h-gpu{5 + i}", "host": "h", "gpu": 5 + i,
            "state": "training", "tokens_per_s": tps, "wait_frac": wait_frac, "waiting_s": None, "credit": 1,
            "in_flight": 2, "gpu_util": 95.0, "step": 100, "stats": {}, **kw}


def status(producers, consumers, *, batches=10, reading=True, full_frac=0.0, gone=(), state="running") -> dict:
    return {"run_id": "20261129T154812Z-7f3a",
            "broker": {"state": state, "endpoints": {"control": "tcp://bh:5555"}},
            "queue": {"batches": batches, "bytes": batches << 20, "capacity_bytes": 4 << 30, "reading": reading,
                      "full_frac": full_frac, "oldest_age_s": 3.0, "in_flight_batches": 6},
            "samples": {"total": 1000, "pending": 500, "leased": 100, "done": 300},
            "rates": {"batches_in": 500, "batches_in_per_s": 1.0, "batches_out_per_s": 1.0},
            "peers": [*producers, *consumers], "gone": list(gone)}


def field_run(**kw) -> dict:
    """The field's topology (docs/DESIGN.md incidents): 5 targets at 4.34 Ktok/s, 3 drafters at 7.23."""
    return status([producer(i, 4.34 * K) for i in range(5)], [consumer(i, 7.23 * K) for i in range(3)], **kw)


def test_best_move_balances_supply_and_demand():
    # targets could make 2x what they do (blocked half the time): 43.4 supply vs 21.7 demand
    assert best_move(5, 8.68 * K, 3, 7.23 * K) == (1, pytest.approx(21.69 * K), pytest.approx(28.92 * K))
    assert best_move(1, 100.0, 2, 1000.0) == (-1, 100.0, 200.0)  # drafters idle: give targets one
    assert best_move(2, 10.0, 2, 10.0)[0] == 0  # balanced: stay
    assert best_move(1, 1.0, 1, 100.0)[0] == 0  # one of each: nothing to move


def test_full_queue_names_the_drafters_and_suggests_moving_a_target_gpu():
    d = diagnose(field_run(reading=False, full_frac=0.5, batches=40))
    assert d["code"] == "targets_backed_up" and d["limited_by"] == "drafters"
    assert d["text"].startswith("drafters limit throughput") and "blocked on send 50%" in d["text"]
    assert d["suggestion"] == ("move 1 GPU from targets to drafters (if the GPUs are alike): "
                               "est. 21.7 Ktok/s -> 28.9 Ktok/s")


def test_waiting_drafters_name_the_targets_and_suggest_the_other_way():
    cons = [consumer(i, 5 * K, wait_frac=0.6, waiting_s=1.0) for i in range(4)]
    d = diagnose(status([producer(i, 5 * K) for i in range(4)], cons, batches=0))
    assert d["code"] == "drafters_starved" and d["limited_by"] == "targets"
    assert d["text"].startswith("targets limit throughput") and "4 of 4 drafters waiting" in d["text"]
    # drafters could do 12.5K each (5K / (1 - 0.6)): supply 4x5K, demand 50K. Moving 1 gives
    # min(25K, 37.5K) = 25K; moving 2 gives min(30K, 25K), no better: the smaller move wins.
    assert d["suggestion"] == ("move 1 GPU from drafters to targets (if the GPUs are alike): "
                               "est. 20.0 Ktok/s -> 25.0 Ktok/s")


def test_one_lagging_drafter_is_named():
    cons = [consumer(0, 7 * K), consumer(1, 7 * K), consumer(2, 1 * K)]
    d = diagnose(status([producer(i, 4 * K) for i in range(5)], cons, reading=False, full_frac=0.8))
    assert d["code"] == "targets_backed_up"
    assert "slowest drafter c2 (h-gpu7) at 1.0 Ktok/s (the others' median 7.0 Ktok/s)" in d["text"]


def test_no_move_possible_suggests_adding_gpus():
    d = diagnose(status([producer(0, 100.0)], [consumer(0, 100.0, wait_frac=0.9, waiting_s=2.0)], batches=0))
    assert d["code"] == "drafters_starved"
    assert d["suggestion"].startswith("add target GPUs: the drafters could take ~10.0x")


def test_a_growing_queue_names_the_drafters_before_it_is_full():
    st = status([producer(0, 384.0)], [consumer(0, 159.0, wait_frac=0.03)], batches=156)
    d = diagnose(st)
    assert d["code"] == "queue_growing" and d["limited_by"] == "drafters"
    assert d["text"].startswith("drafters limit throughput: queue growing (156 batches, 156.0 MiB of 4.0 GiB")
    # 384 / (159 / 0.97)
    assert d["suggestion"] == "add drafter GPUs: the targets could make ~2.3x what the drafters train"


def test_balanced_when_neither_side_waits():
    d = diagnose(field_run(full_frac=0.05))
    assert d["code"] == "balanced" and d["limited_by"] is None


def test_lost_drafter_outranks_the_balance_and_says_its_last_step():
    gone = [{"peer": "c9", "role": "consumer", "instance": "h-gpu9", "state": "lost", "ago_s": 12.0,
             "reason": "silent for 10.2s (timeout 10.0s)", "last_step": 690, "held": {"in_flight": 3}}]
    d = diagnose(field_run(reading=False, full_frac=0.9, gone=gone))
    assert d["code"] == "peer_lost" and d["limited_by"] == "drafters"
    assert "drafter c9 (h-gpu9) lost 12s ago: silent for 10.2s" in d["text"] and "last step 690" in d["text"]
    assert "3 unacked batches were requeued" in d["text"] and "3 drafters carry on" in d["suggestion"]
    # history: long ago, or the same instance is back
    old = copy.deepcopy(gone)
    old[0]["ago_s"] = 3600.0
    assert diagnose(field_run(gone=old))["code"] == "balanced"
    back = copy.deepcopy(gone)
    back[0]["instance"] = "h-gpu5"  # consumer(0) is live under that name again
    assert diagnose(field_run(gone=back))["code"] == "balanced"
    left = copy.deepcopy(gone)
    left[0]["state"] = "left"  # a bye is not a failure
    assert diagnose(field_run(gone=left))["code"] == "balanced"


def test_a_target_that_stopped_on_a_bad_row_says_why_and_the_fix_not_start_one():
    """Issue 29 item 4: its `failed` is in the gone row; the run waits on it."""
    failure = {"code": "bad_row", "reason": "/d/chats.jsonl:17: invalid JSON: Expecting value",
               "source": "/d/chats.jsonl:17", "hint": "fix or remove the row at /d/chats.jsonl:17 and restart the "
                                                       "producer, or restart it with --skip-bad-rows (...)"}
    gone = [{"peer": "p1", "role": "producer", "instance": "h-gpu0", "state": "left", "ago_s": 4000.0,
             "reason": "failed", "held": {"samples_returned": 256}, "failure": failure}]
    d = diagnose(status([], [consumer(0, 0.0, waiting_s=9.0)], batches=0, gone=gone))
    assert d["code"] == "peer_failed" and d["limited_by"] == "targets"
    assert "target p1 (h-gpu0) stopped" in d["text"] and "on a bad dataset row: /d/chats.jsonl:17" in d["text"]
    assert "--skip-bad-rows" in d["suggestion"] and "no target is left: the run waits" in d["suggestion"]
    assert "start dflash-produce" not in d["suggestion"]
    # a restarted producer makes up for it; an old failure while others carry on is history
    assert diagnose(status([producer(0, 4 * K)], [consumer(0, 7 * K)], gone=gone))["code"] != "peer_failed"


def test_lease_starvation_is_named_instead_of_more_cores():
    """Issue 29 item 5: a live target without a lease while every sample left is leased to
    another: more targets or cores would not help (a CPU run, where that was the advice)."""
    prods = [producer(0, 300.0, gpu=None, leases_open=1), producer(1, 0.0, gpu=None, leases_open=0, in_flight=0)]
    cons = [consumer(0, 100.0, wait_frac=0.8, waiting_s=2.0, gpu=None)]
    st = status(prods, cons, batches=0)
    st["samples"].update(pending=0, leased=30)
    st["config"] = {"lease_size": 256}
    d = diagnose(st)
    assert d["code"] == "lease_starved" and d["limited_by"] == "targets"
    assert "1 of 2 targets have no work (p1 (h-gpu1))" in d["text"] and "30 of them to p0 (h-gpu0)" in d["text"]
    assert "more cores" not in d["suggestion"] and "--lease-size (now 256)" in d["suggestion"]
    st["samples"]["pending"] = 40  # work left to lease: the targets' own pace is the limit
    assert diagnose(st)["code"] == "drafters_starved"


def test_oom_backoff_names_the_peer_and_its_memory():
    prods = [producer(i, 4 * K) for i in range(5)]
    prods[3].update(oom_backoff=True, gpu_mem_used=94 * 2**30, gpu_mem_total=96 * 2**30, stats={"ooms": 2})
    d = diagnose(status(prods, [consumer(i, 7 * K) for i in range(3)]))
    assert d["code"] == "oom_backoff" and d["limited_by"] == "targets"
    assert "target p3 (h-gpu3) is in OOM backoff" in d["text"] and "(2 times)" in d["text"]
    assert "GPU 3: 94.0 of 96.0 GiB used" in d["text"] and "--token-budget" in d["suggestion"]
    # a drafter's backoff (consumers/training/step_oom.py): its steps run in micro-batches
    cons = [consumer(i, 7 * K) for i in range(3)]
    cons[1].update(oom_backoff=True, stats={"ooms": 1})
    d = diagnose(status([producer(i, 4 * K) for i in range(5)], cons))
    assert d["code"] == "oom_backoff" and d["limited_by"] == "drafters"
    assert "drafter c1 (h-gpu6) is in OOM backoff" in d["text"] and "splits its steps into micro-batches" in d["text"]
    assert "the targets' --token-budget" in d["suggestion"]


def test_idle_drafter_gpus_with_work_waiting_incident_6():
    cons = [consumer(0, 5.4 * K), consumer(1, 0.0, gpu_util=0.0), consumer(2, 0.0, gpu_util=0.0)]
    d = diagnose(status([producer(i, 4 * K) for i in range(5)], cons, batches=30, reading=False, full_frac=1.0))
    assert d["code"] == "gpu_idle" and d["limited_by"] == "drafters"
    assert d["text"].startswith("2 of 3 drafter GPUs idle (c1 (h-gpu6) 0% util, c2 (h-gpu7) 0% util)")


def test_idle_gpu_explained_by_starvation_is_the_balance_not_an_idle_alarm():
    cons = [consumer(i, 100.0, wait_frac=0.9, waiting_s=3.0, gpu_util=0.0) for i in range(3)]
    d = diagnose(status([producer(0, 300.0)], cons, batches=0))
    assert d["code"] == "drafters_starved"


def test_drafter_without_credit_while_batches_wait_is_idle():
    cons = [consumer(0, 5 * K), consumer(1, 0.0, credit=0, in_flight=0, gpu_util=None)]
    d = diagnose(status([producer(i, 4 * K) for i in range(2)], cons, batches=12))
    assert d["code"] == "gpu_idle" and "credit 0, nothing in flight" in d["text"]


def test_missing_roles_starting_stopping_finishing():
    assert diagnose(status([], []))["code"] == "no_peers"
    d = diagnose(status([producer(0, 1.0)], [], batches=7))
    assert d["code"] == "no_drafters" and "7 batches" in d["text"] and "tcp://bh:5555" in d["suggestion"]
    assert diagnose(status([], [consumer(0, 1.0)]))["code"] == "no_targets"
    done = status([], [consumer(0, 1.0)])
    done["samples"].update(pending=0, leased=0)
    assert diagnose(done)["code"] == "finishing"
    fresh = status([producer(0, 0.0)], [consumer(0, 0.0)])
    fresh["rates"]["batches_in"] = 0
    assert diagnose(fresh)["code"] == "starting"
    assert diagnose(field_run(state="stopping"))["code"] == "stopping"


def test_a_sparse_map_does_not_raise():
    assert diagnose({})["code"] == "no_peers"
    d = diagnose({"peers": [{"role": "producer", "peer": "p1"}, {"role": "consumer", "peer": "c1"}],
                  "rates": {"batches_in": 3}})
    assert d["code"] in ("balanced", "drafters_starved", "targets_backed_up")
