"""One producer over two processes (`--tensor-parallel` under torchrun, gloo on CPU; issue
22): the target sharded by transformers' tensor parallelism captures the features a
single process captures, for a dense (Llama) and a mixture-of-experts (Qwen3-MoE) target,
and a run of broker + sharded producer + consumer, every role its own process, trains to
the end with every sample committed once."""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash.producers.build import _check_packing
from dflash.producers.target import load_target
from dflash.protocol.sockets import free_port_block
from dflash.tools.families import build, tiny_config

pytestmark = pytest.mark.integration

WORKER = Path(__file__).with_name("shard_capture_worker.py")
LAYERS = [0, 1, 2]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(OMP_NUM_THREADS="1", DFLASH_LOG_JSON="1")
    return env


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]


def _packed_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    lens = [17, 9, 30]
    ids = torch.randint(3, vocab, (sum(lens),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])  # restarting positions: three packed sequences
    return ids, pos


FAMILIES = ["llama", "qwen3_moe"]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Both targets captured by one 2-process torchrun launch: (folder, batch, results dir)."""
    tmp = tmp_path_factory.mktemp("sharded")
    for family in FAMILIES:
        torch.manual_seed(0)
        build(tiny_config(family, vocab=512)).save_pretrained(tmp / family)
    ids, pos = _packed_batch(512)
    torch.save({"input_ids": ids, "position_ids": pos}, tmp / "batch.pt")
    res = subprocess.run(_torchrun(str(WORKER), str(tmp / "batch.pt"), str(tmp), *(str(tmp / f) for f in FAMILIES)),
                         env=_env(), capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return tmp, ids, pos


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", FAMILIES)
def test_two_process_capture_equals_the_single_process_capture(family, sharded):
    torch.set_num_threads(1)
    tmp, ids, pos = sharded
    single = load_target(str(tmp / family), ",".join(map(str, LAYERS)), device=torch.device("cpu"), dtype="float32")
    _check_packing(single, auto_attn=True)
    want = single.capture(ids, pos)
    got = torch.load(tmp / f"{family}.pt")
    assert got["world"] == 2 and got["attn_impl"] == single.info.attn_impl
    # Really sharded: each rank holds half of every attention projection (and of the experts).
    q = [n for n in got["full"] if n.endswith("self_attn.q_proj.weight")]
    assert q and all(got["local"][n][0] * 2 == got["full"][n][0] for n in q)
    if family == "qwen3_moe":
        # transformers up to 5.2x shards experts by its tensor-parallel plan, later ones by the
        # expert-parallel plan (runtime/hf_compat.sharded_config): each rank holds half either way.
        experts = [n for n in got["full"] if ".experts." in n]
        assert experts and all(n in got["local"] for n in experts), sorted(got["local"])
        assert all(2 * math.prod(got["local"][n]) == math.prod(got["full"][n]) for n in experts)
    err = (got["hidden"] - want).abs().max().item()
    print(f"\n{family}: sharded vs single-process capture, max abs difference {err:.2e}")
    # Not bitwise: the row-parallel layers' all-reduce sums the two halves in another order.
    torch.testing.assert_close(got["hidden"], want, rtol=0, atol=1e-5)


def _wait(procs: dict, timeout_s: float) -> dict[str, int]:
    """Until every process ended, one failed (the others would wait for it) or the time ran out."""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
            if any(p.poll() for p in procs.values()):
                break
            time.sleep(0.2)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return {name: p.returncode for name, p in procs.items()}


def _why(out: str) -> str:
    """What a failed process printed besides its JSON log lines (a C++ abort's message, a
    traceback), then the tail: torchrun's own report alone can fill the tail."""
    plain = [line for line in out.splitlines() if not line.startswith("{")]
    return "\n".join(plain[:40]) + "\n...\n" + out[-1500:]


@pytest.mark.timeout(360)
def test_a_run_with_a_sharded_producer_trains_to_the_end(tmp_path):
    import dflash.producers.sample_data as sample_data
    from dflash.tools.tiny import tiny_target

    n_rows = 24
    chats = (Path(sample_data.__file__).parent / "chats.jsonl").read_text().splitlines()[:n_rows]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(chats) + "\n")
    # embedding rows padded to a multiple of the ranks, as real models pad them (test_an_uneven_head_...)
    target, runs = str(tiny_target(model_vocab=776)), str(tmp_path / "runs")
    base = free_port_block(4)
    broker = f"tcp://127.0.0.1:{base}"
    env, outs, procs = _env(), {}, {}

    def start(name, cmd):
        outs[name] = tmp_path / f"{name}.out"
        with open(outs[name], "w") as f:
            procs[name] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)

    start("broker", [sys.executable, "-m", "dflash.broker.broker_command", "--bind", "127.0.0.1", "--port", str(base),
                     "--data-in-port", str(base + 1), "--data-out-ports", f"{base + 2}-{base + 3}", "--runs-dir", runs,
                     "--epochs", "1", "--consumers", "1", "--heartbeat-s", "0.5", "--timeout-s", "60",
                     "--lease-size", "8"])
    start("producer", _torchrun("-m", "dflash.producers.produce_command", "--tensor-parallel", "--broker", broker, "--runs-dir",
                                runs, "--instance", "tp0", "--device", "cpu", "--target", target, "--data", str(data),
                                "--token-budget", "256", "--max-length", "256", "--max-batch-size", "4",
                                "--lease-size", "8", "--prefetch", "2"))
    start("consumer", [sys.executable, "-m", "dflash.consumers.process.consume_command", "--broker", broker, "--runs-dir", runs,
                       "--instance", "c0", "--target", target, "--block-size", "4", "--anchors", "16",
                       "--draft-layers", "1", "--lr", "3e-3", "--save-every", "1000", "--log-position-every", "0"])
    codes = _wait(procs, 330)
    if any(codes.values()):
        pytest.fail(f"exit codes {codes}: " + json.dumps({n: _why(outs[n].read_text()) for n in procs if codes[n]}))

    (run_dir,) = [p for p in Path(runs).iterdir() if p.name != "latest"]
    db = sqlite3.connect(run_dir / "ledger.sqlite")
    rows = db.execute("SELECT epoch, sample, state FROM samples").fetchall()
    assert sorted((e, s) for e, s, _ in rows) == [(0, s) for s in range(n_rows)]
    assert {state for *_, state in rows} == {"committed"}
    # Rank 0 alone is the producer of the run (one log file), the follower ran every pass with it.
    assert sorted(p.name for p in (run_dir / "logs").glob("producer-*.jsonl")) == ["producer-tp0.jsonl"]
    events = [json.loads(x) for x in (run_dir / "logs" / "producer-tp0.jsonl").read_text().splitlines()]
    (sharded,) = [e for e in events if e["event"] == "produce.sharded"]
    assert sharded["world_size"] == 2 and sharded["backend"] == "gloo"
    done = next(e for e in events if e["event"] == "produce.done")
    assert done["samples"] == n_rows
    follower = [json.loads(x) for x in outs["producer"].read_text().splitlines()
                if x.startswith("{") and '"produce.follower_done"' in x]
    assert len(follower) == 1 and follower[0]["rank"] == 1 and follower[0]["passes"] > done["batches"]
    consumer = [json.loads(x) for x in (run_dir / "logs" / "consumer-c0.jsonl").read_text().splitlines()]
    end = next(e for e in consumer if e["event"] == "consume.done")
    assert end["samples"] == n_rows and end["step"] > 0


def test_what_cannot_be_sharded_is_refused_naming_why(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from dflash.producers.produce_command import main
    from dflash.producers.producer_config import ProducerConfig
    from dflash.producers.shard import ShardError, world_from_env
    from dflash.producers.target import TargetError

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ShardError, match="needs a torchrun launch"):
        world_from_env()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ShardError, match="WORLD_SIZE 1: launch 2 or more processes"):
        world_from_env()
    with pytest.raises(ValueError, match="--regenerate is not supported with --tensor-parallel"):
        ProducerConfig(target="t", data="d", tensor_parallel=True, regenerate=True).check()
    with pytest.raises(ValueError, match="--tensor-parallel takes no --gpu"):
        ProducerConfig(target="t", data="d", tensor_parallel=True, gpu=1).check()
    folder = tmp_path / "gpt2"
    build(tiny_config("gpt2", vocab=512)).save_pretrained(folder)
    with pytest.raises(TargetError, match="gpt2: transformers has no tensor-parallel plan"):
        load_target(str(folder), "0,1", device=torch.device("cpu"), tensor_parallel=True)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    from dflash.producers.sample_data import CHATS_PATH
    from dflash.tools.tiny import tiny_target

    res = CliRunner().invoke(main, ["--tensor-parallel", "--device", "cpu", "--target", str(tiny_target()), "--data",
                                    str(CHATS_PATH), "--dry-run"])
    assert res.exit_code != 0 and "--tensor-parallel needs a torchrun launch" in res.output


def _splits_heads_evenly_only() -> bool:
    import inspect

    import transformers.distributed.tensor_parallel as tp

    from dflash.producers.target import UNEVEN_HEAD
    return UNEVEN_HEAD in inspect.getsource(tp)


@pytest.mark.timeout(240)
def test_an_uneven_head_is_refused_naming_the_rows_and_ranks_not_retried_as_attention(tmp_path):
    # The lower bound of transformers splits an output head over the ranks only in equal parts;
    # the tiny target's 769 rows do not split 2 ways. Newer versions split it unevenly (the run
    # test above covers sharding; this one runs where the refusal exists: .ci/run's lower bound).
    if not _splits_heads_evenly_only():
        pytest.skip("this transformers splits an output head unevenly")
    import dflash.producers.sample_data as sample_data
    from dflash.tools.tiny import tiny_target

    target, data = tiny_target(), tmp_path / "chats.jsonl"
    data.write_text((Path(sample_data.__file__).parent / "chats.jsonl").read_text().splitlines()[0] + "\n")
    r = subprocess.run(_torchrun("-m", "dflash.producers.produce_command", "--tensor-parallel", "--dry-run",
                                 "--device", "cpu", "--target", str(target), "--data", str(data)),
                       capture_output=True, text=True, timeout=200, env=_env())
    assert r.returncode != 0
    assert "has 769 rows" in r.stderr and "2 equal parts" in r.stderr, r.stderr[-2000:]
    assert "produce.attn_fallback" not in r.stdout + r.stderr
