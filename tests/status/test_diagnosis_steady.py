"""dflash-status tells the truth (issue 20): the diagnosis has hysteresis (a shared-GPU run
flapped between five codes in three minutes), a lost peer that came back under its new
default name clears peer_lost, the suggested log command includes errors, a CPU run is
never told to move GPUs. broker/diagnosis.py in-process, with a fake clock."""

from __future__ import annotations

import copy

from tests.status.test_diagnosis import K, consumer, field_run, producer, status

from dflash.broker.diagnosis import HOLD_S, Steady, diagnose
import pytest

pytestmark = pytest.mark.unit


def _starved():
    return status([producer(0, 1 * K)], [consumer(i, 5 * K, wait_frac=0.8, waiting_s=1.0) for i in range(2)],
                  batches=0)


def _backed_up():
    return status([producer(i, 4 * K) for i in range(2)], [consumer(0, 2 * K)], reading=False, full_frac=0.9)


def test_a_new_bottleneck_is_reported_only_once_it_held():
    s, now = Steady(), 1000.0
    first = s.update(diagnose(_starved()), now)
    assert first["code"] == "drafters_starved"  # the first diagnosis: at once
    # it flips for a moment, then back: never reported
    for t in (5, 10, 15):
        d = s.update(diagnose(_backed_up()), now + t)
        assert d["code"] == "drafters_starved" and d["pending"]["code"] == "targets_backed_up"
    assert s.update(diagnose(_starved()), now + 20)["code"] == "drafters_starved"
    assert "pending" not in s.update(diagnose(_starved()), now + 21)
    # a change that holds is reported after HOLD_S without a break
    start = now + 30
    assert s.update(diagnose(_backed_up()), start)["code"] == "drafters_starved"
    assert s.update(diagnose(_backed_up()), start + HOLD_S - 1)["code"] == "drafters_starved"
    assert s.update(diagnose(_backed_up()), start + HOLD_S)["code"] == "targets_backed_up"


def test_urgent_codes_are_reported_at_once():
    s = Steady()
    s.update(diagnose(_starved()), 0.0)
    gone = [{"peer": "c9", "role": "consumer", "instance": "h-cpu-77", "state": "lost", "ago_s": 3.0,
             "reason": "silent", "last_step": 4, "held": {"in_flight": 1}}]
    assert s.update(diagnose(field_run(gone=gone)), 1.0)["code"] == "peer_lost"


def test_a_change_is_logged_once_through_the_broker_path():
    """What broker/status.py logs: the reported code; flapping under HOLD_S logs nothing."""
    s, logged, last = Steady(), [], None
    seq = [_starved()] + [_backed_up(), _starved()] * 5 + [_backed_up()] * 8
    for i, st in enumerate(seq):
        code = s.update(diagnose(st), i * 5.0)["code"]
        if code != last:
            logged.append(code)
            last = code
    assert logged == ["drafters_starved", "targets_backed_up"]


def test_a_lost_peer_back_under_a_new_name_clears_peer_lost():
    gone = [{"peer": "c9", "role": "consumer", "instance": "h-cuda7-4711", "state": "lost", "ago_s": 40.0,
             "reason": "silent for 10.2s", "last_step": 690, "held": {"in_flight": 3}}]
    assert diagnose(field_run(gone=gone))["code"] == "peer_lost"
    st = field_run(gone=gone)
    st["peers"].append(consumer(7, 7 * K, instance="h-cuda7-5120", peer="c10", connected_s=12.0))
    assert diagnose(st)["code"] != "peer_lost"
    # a consumer that was there before the loss does not make up for it
    st = field_run(gone=gone)
    for p in st["peers"]:
        p["connected_s"] = 600.0
    assert diagnose(st)["code"] == "peer_lost"
    # two losses, one newcomer: still one lost
    two = gone + [dict(copy.deepcopy(gone[0]), peer="c8", instance="h-cuda6-4700", ago_s=30.0)]
    st = field_run(gone=two)
    st["peers"].append(consumer(7, 7 * K, peer="c10", instance="h-cuda7-5120", connected_s=12.0))
    d = diagnose(st)
    assert d["code"] == "peer_lost" and "c9" in d["text"] and "c8" not in d["text"]


def test_suggested_log_command_includes_errors():
    gone = [{"peer": "c9", "role": "consumer", "instance": "x", "state": "lost", "ago_s": 3.0, "reason": "silent",
             "held": {}}]
    assert "--level warning --level error" in diagnose(field_run(gone=gone))["suggestion"]


def test_a_cpu_run_is_not_told_to_move_gpus():
    gpu = status([producer(0, 1 * K)], [consumer(i, 5 * K, wait_frac=0.8, waiting_s=1.0) for i in range(3)], batches=0)
    assert "move" in diagnose(gpu)["suggestion"]
    cpu = copy.deepcopy(gpu)
    for p in cpu["peers"]:
        p["gpu"], p["gpu_util"] = None, None
    d = diagnose(cpu)
    assert d["code"] == "drafters_starved" and "GPU" not in (d["suggestion"] or "").replace("(or GPUs)", "")
    assert "move" not in (d["suggestion"] or "")
