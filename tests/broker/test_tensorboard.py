"""dflash-broker --tensorboard (issue 20): a real broker's broker.progress figures, read
back from its TensorBoard event files with EventAccumulator, under the JSON field names
and with the values of the JSON lines."""

from __future__ import annotations

import pytest

from tests.harness.wait import wait_until

pytestmark = pytest.mark.integration

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                        reason="the tensorboard extra is not installed")


def test_broker_progress_scalars_are_the_json_lines(start_broker, tmp_path):
    tb = tmp_path / "tb"
    b = start_broker("--progress-s", "0.3", "--tensorboard", str(tb))
    # Three lines, not an uptime: under load the broker's first line can come at 2 s of uptime
    wait_until(lambda: len(b.events("broker.progress")) >= 3, 60, "3 broker.progress lines")
    assert b.stop() == 0
    lines = b.events("broker.progress")
    acc = event_accumulator.EventAccumulator(str(tb / b.run_id))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"broker.progress/queue_bytes", "broker.progress/samples_trained", "broker.progress/uptime_s"} <= tags
    got = [(e.step, e.value) for e in acc.Scalars("broker.progress/uptime_s")]
    want = [(int(e["uptime_s"]), e["uptime_s"]) for e in lines]  # step: whole seconds since start
    assert len(got) == len(want) >= 3
    assert all(g[0] == w[0] and abs(g[1] - w[1]) < 1e-3 for g, w in zip(got, want)), (got, want)


def test_broker_progress_in_an_offline_wandb_run(start_broker, tmp_path):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")

    from tests.consumers.test_wandb_offline import read_records

    b = start_broker("--progress-s", "0.3", "--wandb", "dflash-test",
                     env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path / "w")})
    b.wait_event("broker.progress", 20, lambda e: e["uptime_s"] >= 1.5)
    assert b.stop() == 0
    lines = b.events("broker.progress")
    assert all(line.lstrip().startswith("{") for line in b.lines if line.strip())  # wandb kept off stdout
    (f,) = b.run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history = [{(i.key or "/".join(i.nested_key)): __import__("json").loads(i.value_json) for i in r.history.item}
               for r in read_records(f) if r.WhichOneof("record_type") == "history"]
    assert [h["broker.progress/uptime_s"] for h in history] == pytest.approx([e["uptime_s"] for e in lines])
    assert all("broker.progress/queue_bytes" in h and "broker.progress/samples_trained" in h for h in history)
