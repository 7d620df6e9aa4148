"""Figures and names that are true (issue 36, finding 7), socket-free: broker/diagnosis.py on
hand-written status maps with a fake clock. A report of "queue full (59 batches)" does not
outlive an emptied queue while other codes take turns; an empty queue is never called full;
targets and drafters on one GPU are not told to add drafter GPUs or move GPUs."""

from __future__ import annotations

import pytest

from dflash.broker.diagnosis import HOLD_S, Steady, diagnose
from tests.status.test_diagnosis import K, consumer, producer, status

pytestmark = pytest.mark.unit


def _backed_up():
    return status([producer(0, 4 * K)], [consumer(0, 2 * K)], batches=59, reading=False, full_frac=0.9)


def _starved():
    return status([producer(0, 1 * K)], [consumer(0, 5 * K, wait_frac=0.8, waiting_s=1.0)], batches=0)


def _balanced():
    return status([producer(0, 3 * K)], [consumer(0, 3 * K, wait_frac=0.1)], batches=0)


def test_a_report_does_not_outlive_its_situation_while_other_codes_take_turns():
    s = Steady()
    assert s.update(diagnose(_backed_up()), 0.0)["code"] == "targets_backed_up"
    seen = []
    for i in range(48):  # four minutes of an empty queue: drafters starved, then balanced, by turns
        t = 10.0 + 5.0 * i
        d = s.update(diagnose(_starved() if i % 2 else _balanced()), t)
        seen.append((t, d["code"], d["text"]))
    stale = [(t, code) for t, code, text in seen if code == "targets_backed_up"]
    assert stale and max(t for t, _ in stale) < 10.0 + HOLD_S, stale  # held no longer than the hold
    assert all("59 batches" not in text for t, _, text in seen if t >= 10.0 + HOLD_S)


def test_an_empty_queue_is_not_called_full():
    # the producers were blocked on send for most of the last 10 s, but the drafters have
    # emptied the queue since and it reads again
    d = diagnose(status([producer(0, 4 * K)], [consumer(0, 2 * K)], batches=0, reading=True, full_frac=0.6))
    assert d["code"] != "targets_backed_up" and "queue full" not in d["text"], d
    # a queue that holds batches and was full most of the window still is
    d = diagnose(status([producer(0, 4 * K)], [consumer(0, 2 * K)], batches=12, reading=True, full_frac=0.6))
    assert d["code"] == "targets_backed_up" and "queue full (12 batches" in d["text"], d


def test_targets_and_drafters_on_one_gpu_are_not_told_to_add_drafter_gpus():
    # one GPU: the producer and the consumer both say gpu 0 on host h; the queue is full and the
    # consumer waits a third of the time (its waits are the producer's turns on the GPU)
    shared = status([producer(0, 4 * K)], [consumer(0, 2 * K, wait_frac=0.33, gpu=0)], batches=59, reading=False,
                    full_frac=0.6)
    d = diagnose(shared)
    assert d["code"] == "targets_backed_up"
    assert "add drafter GPUs" not in d["suggestion"] and "move" not in d["suggestion"], d
    assert "share GPU h:0" in d["suggestion"] and "GPU of its own" in d["suggestion"], d
    # the same figures on two GPUs (or two hosts) keep the GPU arithmetic
    apart = status([producer(0, 4 * K)], [consumer(0, 2 * K, wait_frac=0.33, gpu=0, host="other")], batches=59,
                   reading=False, full_frac=0.6)
    assert "share GPU" not in (diagnose(apart)["suggestion"] or "")
    assert diagnose(status([producer(0, 4 * K)], [consumer(0, 2 * K, wait_frac=0.33)], batches=59, reading=False,
                           full_frac=0.6))["suggestion"].startswith("add drafter GPUs")
