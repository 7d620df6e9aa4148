"""--tensorboard (issue 20): a real CPU run's TensorBoard event files, read back with
TensorBoard's own EventAccumulator, hold rank 0's train.step figures under the JSON
field names, at their steps, with the values of the JSON lines."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from dflash.consumers.process.consume_command import main
from dflash.tools.tiny import tiny_target

pytestmark = pytest.mark.unit

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                        reason="the tensorboard extra is not installed")

CLEAN = {k: None for k in os.environ if k.startswith("DFLASH_")}


def test_tensorboard_scalars_are_the_json_lines(tmp_path):
    runs, tb = tmp_path / "runs", tmp_path / "tb"
    r = CliRunner().invoke(main, ["--target", str(tiny_target()), "--runs-dir", str(runs), "--draft-layers", "1",
                                  "--block-size", "4", "--anchors", "4", "--synthetic-seq-len", "32",
                                  "--synthetic-seqs", "2", "--synthetic-batches", "4", "--save-every", "0",
                                  "--tensorboard", str(tb)], env=CLEAN)
    assert r.exit_code == 0, r.output
    run = (runs / "latest").resolve()
    (log,) = (run / "logs").glob("consumer-*.jsonl")
    steps = [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "train.step"]
    assert len(steps) == 4
    acc = event_accumulator.EventAccumulator(str(tb / run.name))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train.step/loss", "train.step/acc", "train.step/streak", "train.step/lr",
            "train.step/tokens_per_s"} <= tags, tags
    for key in ("loss", "acc", "lr", "tokens_per_s"):
        got = [(e.step, e.value) for e in acc.Scalars(f"train.step/{key}")]
        want = [(s["step"], s[key]) for s in steps]
        assert [g[0] for g in got] == [w[0] for w in want]
        assert all(abs(g[1] - w[1]) <= 1e-6 * max(1.0, abs(w[1])) for g, w in zip(got, want)), (key, got, want)


def test_without_the_extra_the_option_says_how_to_get_it(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *a, **kw):  # the extra not installed: its import fails as it would
        if name == "torch.utils.tensorboard":
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    r = CliRunner().invoke(main, ["--target", str(tiny_target()), "--runs-dir", str(tmp_path / "runs"),
                                  "--synthetic-batches", "1", "--draft-layers", "1", "--block-size", "4",
                                  "--anchors", "4", "--synthetic-seq-len", "32", "--tensorboard", str(tmp_path / "tb")],
                           env=CLEAN)
    assert r.exit_code == 2 and "pip install 'dflash-pipeline[tensorboard]'" in r.output, r.output
