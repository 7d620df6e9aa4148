"""dflash-plot on a real run: dflash-consume trains a tiny drafter on its synthetic stream
(a subprocess, real logs), then the PNG is checked chunk by chunk (signature, CRCs, IHDR
size, IEND) and decoded."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

STEPS = 12
CONSUME = "import torch; torch.set_num_threads(1); from dflash.consumers.process.consume_command import main; main()"


def mask_id(target) -> int:
    """The tiny tokenizer's <|mask|> row: DFlash's MASK token, passed explicitly."""
    from dflash.tools.tiny import MASK_TOKEN

    added = json.loads((target / "tokenizer.json").read_text())["added_tokens"]
    return next(a["id"] for a in added if a["content"] == MASK_TOKEN)


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, payload) of every chunk; AssertionError on a bad signature or CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    chunks, i = [], 8
    while i < len(data):
        (n,) = struct.unpack(">I", data[i:i + 4])
        kind, payload = data[i + 4:i + 8], data[i + 8:i + 8 + n]
        (crc,) = struct.unpack(">I", data[i + 8 + n:i + 12 + n])
        assert zlib.crc32(kind + payload) == crc, f"bad CRC in {kind!r}"
        chunks.append((kind, payload))
        i += 12 + n
    return chunks


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    from dflash.tools.tiny import tiny_target

    runs = tmp_path_factory.mktemp("plot") / "runs"
    target = tiny_target()
    args = ["--target", str(target), "--mask-token-id", str(mask_id(target)), "--runs-dir", str(runs),
            "--draft-layers", "1", "--target-layers", "1,2", "--block-size", "4", "--anchors", "6",
            "--synthetic-seq-len", "32", "--synthetic-seqs", "2",
            "--synthetic-batches", str(STEPS), "--log-position-every", "4", "--save-every", "0",
            "--instance", "plot-cpu"]
    r = subprocess.run([sys.executable, "-c", CONSUME, *args], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return (runs / "latest").resolve()


def test_plot_of_a_real_run_is_a_valid_png_of_the_expected_size(trained_run):
    out = trained_run.parent / "curves.png"
    r = subprocess.run([sys.executable, "-m", "dflash.tools.plot", "--runs-dir", str(trained_run.parent),
                        "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"run {trained_run.name}, {STEPS} steps" in r.stdout
    chunks = png_chunks(out.read_bytes())
    kinds = [k for k, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    width, height = struct.unpack(">II", chunks[0][1][:8])
    assert (width, height) == (1200, 675)  # figsize 12 x 6.75 in at dpi 100

    import matplotlib.pyplot as plt

    pixels = plt.imread(out)
    assert pixels.shape[:2] == (675, 1200)
    assert pixels[..., :3].std() > 0.05  # curves and text were drawn, not a blank canvas


def test_plot_reads_the_steps_and_position_accuracy_the_run_logged(trained_run):
    from dflash.tools.plot import training_series

    series, position_acc = training_series(trained_run)
    logged = [json.loads(x) for x in (trained_run / "logs" / "consumer-plot-cpu.jsonl").read_text().splitlines()]
    assert series["step"] == [e["step"] for e in logged if e["event"] == "train.step"] == list(range(1, STEPS + 1))
    assert all(isinstance(v, float) for v in series["loss"])
    assert position_acc == [e for e in logged if e["event"] == "train.position_acc"][-1]["acc_by_position"]
    assert len(position_acc) == 3  # block size 4: positions 1..3


def test_plot_of_a_run_without_steps_fails_in_one_line(tmp_path):
    from dflash.runtime.run import make_run_dir, new_run_id

    run = make_run_dir(new_run_id(), tmp_path)
    r = subprocess.run([sys.executable, "-m", "dflash.tools.plot", "--run", str(run)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no train.step lines" in r.stderr
