"""--wandb in offline mode (issue 20): a real CPU run's W&B offline run file, read back
record by record, holds rank 0's train.step figures under the JSON field names at their
steps. The file is W&B's record log (the LevelDB log layout: 32 KiB blocks of records
with a 7-byte header, each a protobuf `Record`); it is read here with wandb's own
protobuf classes."""

from __future__ import annotations

import json
import os
import struct

import pytest
from click.testing import CliRunner

from dflash.consumers.process.consume_command import main
from dflash.tools.tiny import tiny_target

pytestmark = pytest.mark.integration

pytest.importorskip("wandb", reason="the wandb extra is not installed")
pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

CLEAN = {k: None for k in os.environ if k.startswith("DFLASH_")}
BLOCK, HEADER = 32768, 7


def read_records(path) -> list:
    """Every Record of a .wandb file (FULL, or FIRST..MIDDLE..LAST chunks joined)."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", "not a W&B run file"
    out, buf, pos = [], b"", 7
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            pos += left  # zero padding to the end of the block
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def test_an_offline_wandb_run_holds_the_json_lines(tmp_path):
    runs = tmp_path / "runs"
    env = {**CLEAN, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path / "wandb-dir")}
    r = CliRunner().invoke(main, ["--target", str(tiny_target()), "--runs-dir", str(runs), "--draft-layers", "1",
                                  "--block-size", "4", "--anchors", "4", "--synthetic-seq-len", "32",
                                  "--synthetic-seqs", "2", "--synthetic-batches", "3", "--save-every", "0",
                                  "--wandb", "dflash-test"], env=env)
    assert r.exit_code == 0, r.output
    run = (runs / "latest").resolve()
    (log,) = (run / "logs").glob("consumer-*.jsonl")
    steps = [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "train.step"]
    files = list(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, list(run.rglob("*"))
    history = []
    for rec in read_records(files[0]):
        if rec.WhichOneof("record_type") == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    assert [h["_step"] for h in history] == [s["step"] for s in steps]
    for h, s in zip(history, steps):
        for key in ("loss", "acc", "lr", "tokens_per_s"):
            assert h[f"train.step/{key}"] == pytest.approx(s[key], rel=1e-9), (key, h, s)
