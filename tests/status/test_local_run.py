"""`dflash-status --run` on a brokerless run (`dflash-consume --synthetic-batches`, a real
training process): RUNNING while its process lives, FINISHED with its last step once it
logged `train.end`; and the file readers behind the verdicts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from dflash.tools.runstate import count_errors, tail_events
from tests.status.helpers import status_json
from tests.harness.wait import wait_for
import pytest

pytestmark = pytest.mark.integration

CONSUME = "import torch; torch.set_num_threads(1); from dflash.consumers.process.consume_command import main; main()"


def mask_id(target) -> int:
    """The tiny tokenizer's <|mask|> row: DFlash's MASK token, passed explicitly."""
    from dflash.tools.tiny import MASK_TOKEN

    added = json.loads((target / "tokenizer.json").read_text())["added_tokens"]
    return next(a["id"] for a in added if a["content"] == MASK_TOKEN)


def test_local_run_is_running_then_finished(tmp_path):
    from dflash.tools.tiny import tiny_target

    runs = tmp_path / "runs"
    target = tiny_target()
    args = ["--target", str(target), "--mask-token-id", str(mask_id(target)), "--runs-dir", str(runs),
            "--draft-layers", "1", "--target-layers", "1,2", "--block-size", "4", "--anchors", "6",
            "--synthetic-seq-len", "32", "--synthetic-seqs", "2",
            "--synthetic-batches", "100000", "--save-every", "0", "--instance", "local-cpu"]
    p = subprocess.Popen([sys.executable, "-c", CONSUME, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        log = wait_for(lambda: next(iter(runs.glob("*/logs/consumer-local-cpu.jsonl")), None),
                       lambda f: '"train.step"' in f.read_text(), 120, every_s=0.5)
        d = status_json("--run", "latest", "--runs-dir", str(runs), "--timeout-s", "0.3")
        assert d["verdict"] == "RUNNING" and d["live"] is False and p.pid in d["alive_pids"]
        assert d["last_step"] >= 1
    finally:
        p.send_signal(signal.SIGTERM)  # finish the step, final checkpoint, exit 0
        assert p.wait(120) == 0, p.stderr.read()[-2000:]
    steps = [json.loads(x)["step"] for x in log.read_text().splitlines() if '"train.step"' in x]
    d = status_json("--run", "latest", "--runs-dir", str(runs), "--timeout-s", "0.3")
    assert d["verdict"] == "FINISHED" and d["last_step"] == steps[-1] and "train.end: stop" in d["why"]
    assert d["last_checkpoint"].endswith(f"step-{steps[-1]}")


def test_tail_and_error_count_read_big_files_right(tmp_path):
    path = tmp_path / "x.jsonl"
    lines = [json.dumps({"ts": f"{i:06d}", "level": "error" if i % 7 == 0 else "info", "event": "train.step",
                         "step": i}) for i in range(2000)]
    path.write_text("\n".join(lines) + "\n{\"torn")  # a crash mid-line at the end
    tail = tail_events(path, nbytes=500)
    assert tail[-1]["step"] == 1999 and all(e["step"] > 1980 for e in tail)  # the cut first line is dropped
    expected = sum(1 for i in range(2000) if i % 7 == 0)
    assert count_errors(path) == expected
    assert count_errors(path, chunk_bytes=7) == expected  # matches split across chunk borders
