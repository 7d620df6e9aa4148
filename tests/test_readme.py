"""Every command in README.md runs, so the README cannot rot.

The commands are taken from the README's ```bash blocks and run as written, with only
the substitutions a one-machine CPU test needs (`Local.argv`): the broker host becomes
127.0.0.1 on free ports, `--device cuda:N` becomes `--device cpu`, `prompts.jsonl` the user
turns of a small slice of the bundled chats (what dflash-prompts writes), answered by the
target (`--regenerate`, short answers). The hub ID `Qwen/Qwen3-8B` stays as written: a local Hugging
Face cache holds the tiny target under that name. Two producers and two consumers run on
this one host with their default instance names (no `--instance`). Model sizes come
through each command's environment variables (DFLASH_PRODUCE_*, DFLASH_CONSUME_*, ...).
`pip install` is what CI runs first, `python -m pytest -q -n 2` is this suite, and
`dflash-demo` runs in test_demo.py; `dflash-prompts` runs on its own (fewer prompts).

The scenario is the README's own story: start a run, look at it with dflash-status,
crash everything with SIGKILL, resume (the broker with --resume, everything else with its
command unchanged), finish, read the logs with jq, plot.
"""

import json
import os
import re
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from dflash.protocol.sockets import free_port_block
from tests.harness.hub_cache import put_in_hub_cache

from dflash.tools.tiny import tiny_target  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
N_ROWS, EPOCHS = 40, 6
NOISE = ("Loading weights", "NCCL flight recorder", '"GET /checkpoint')
EXPECTED = [
    'pip install -e ".[test]"',
    "dflash-demo",
    "python -m pytest -q -n 2",
    # One GPU, ten minutes
    "dflash-prompts --target HuggingFaceTB/SmolLM2-135M-Instruct --count 8000 --holdout 8 --out prompts.jsonl --gpu 0",
    "dflash-broker --time-budget 7m30s --epochs 20 &",
    "dflash-produce --gpu 0 --target HuggingFaceTB/SmolLM2-135M-Instruct --data prompts.jsonl --regenerate &",
    "dflash-consume --gpu 0 --target HuggingFaceTB/SmolLM2-135M-Instruct",
    "dflash-export latest drafter --target HuggingFaceTB/SmolLM2-135M-Instruct",
    "dflash-eval --target HuggingFaceTB/SmolLM2-135M-Instruct --drafter drafter --prompts prompts.holdout.jsonl "
    "--device cuda:0 --dtype bfloat16",
    # Real use
    "dflash-prompts --target Qwen/Qwen3-8B --count 20000 --out prompts.jsonl --gpu 0",
    "dflash-broker --epochs 6 --consumers 2",
    "dflash-produce --broker tcp://broker-host:5555 --device cuda:0 --target Qwen/Qwen3-8B --data prompts.jsonl "
    "--regenerate",
    "dflash-produce --broker tcp://broker-host:5555 --device cuda:1 --target Qwen/Qwen3-8B --data prompts.jsonl "
    "--regenerate",
    "dflash-consume --broker tcp://broker-host:5555 --device cuda:2 --target Qwen/Qwen3-8B",
    "dflash-consume --broker tcp://broker-host:5555 --device cuda:3 --target Qwen/Qwen3-8B",
    "dflash-status --broker tcp://broker-host:5555",
    "dflash-logs --event train.step --json | jq -c 'select(.rank == 0) | {step, loss, acc, streak, tokens_per_s}'",
    "dflash-plot --out training.png",
    "dflash-broker --resume runs/latest --consumers 2",
]


ONE_GPU = 3  # where the "One GPU, ten minutes" block starts in EXPECTED


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [line.strip() for b in blocks for line in b.splitlines() if line.strip()]


def test_readme_lists_exactly_the_commands_tested_here():
    assert readme_commands() == EXPECTED


class Local:
    """Turns a README command into what runs on this one CPU machine."""

    def __init__(self, tmp: Path):
        self.tmp, self.port = tmp, free_port_block(12)
        self.procs: list[subprocess.Popen] = []
        put_in_hub_cache(tmp / "hf-cache", "Qwen/Qwen3-8B", tiny_target())
        put_in_hub_cache(tmp / "hf-cache", "HuggingFaceTB/SmolLM2-135M-Instruct", tiny_target(family="llama"))
        import dflash.producers.sample_data as pkg

        rows = (Path(pkg.__file__).parent / "chats.jsonl").read_text().splitlines()[:N_ROWS]
        asks = [{"messages": [next(m for m in json.loads(r)["messages"] if m["role"] == "user")]} for r in rows]
        (tmp / "prompts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in asks))
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "HF_"))},
                    "OMP_NUM_THREADS": "1", "DFLASH_LOG_JSON": "1", "HF_HUB_CACHE": str(tmp / "hf-cache"),
                    "HF_HUB_OFFLINE": "1", "DFLASH_PRODUCE_MAX_LENGTH": "512", "DFLASH_PRODUCE_TOKEN_BUDGET": "1024",
                    "DFLASH_CONSUME_ANCHORS": "32", "DFLASH_CONSUME_BLOCK_SIZE": "8", "DFLASH_CONSUME_DRAFT_LAYERS": "1",
                    "DFLASH_CONSUME_SAVE_EVERY": "3", "DFLASH_BROKER_HEARTBEAT_S": "0.5",
                    "DFLASH_PRODUCE_MAX_NEW_TOKENS": "24", "DFLASH_PRODUCE_REGEN_CACHE": str(tmp / "regen")}

    def argv(self, cmd: str) -> list[str]:
        cmd = cmd.replace("tcp://broker-host:5555", f"tcp://127.0.0.1:{self.port}")
        cmd = re.sub(r"--device cuda:\d+", "--device cpu", cmd).removesuffix(" &")  # the caller backgrounds it
        cmd = cmd.replace("--gpu 0", "--device cpu").replace("--dtype bfloat16", "--dtype float32")
        args = cmd.split()
        if args[0] == "dflash-broker":
            p = self.port
            args += ["--bind", "127.0.0.1", "--port", str(p), "--data-in-port", str(p + 1),
                     "--data-out-ports", f"{p + 2}-{p + 11}"]
        return args

    def wait_for_new_run(self, previous: Path | None) -> Path:
        latest = self.tmp / "runs" / "latest"

        def moved():
            return latest.exists() and (previous is None or latest.resolve() != previous)
        _wait(moved, 60, "the broker to create its run")
        return latest.resolve()

    def start(self, cmd: str) -> subprocess.Popen:
        """Output to files (a pipe nobody reads fills up and blocks the process)."""
        n = len(list(self.tmp.glob("proc*.out")))
        out, err = (open(self.tmp / f"proc{n}.{x}", "w") for x in ("out", "err"))
        p = subprocess.Popen(self.argv(cmd), cwd=self.tmp, env=self.env, stdout=out, stderr=err, text=True)
        p.out_path, p.err_path = Path(out.name), Path(err.name)
        out.close(), err.close()
        return p

    def run(self, cmd: str, shell: bool = False) -> subprocess.CompletedProcess:
        if shell:  # a pipeline, as a user types it
            return subprocess.run(cmd, shell=True, cwd=self.tmp, env=self.env, capture_output=True, text=True,
                                  timeout=60)
        return subprocess.run(self.argv(cmd), cwd=self.tmp, env=self.env, capture_output=True, text=True,
                              timeout=60)


def _is_json(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _committed(run_dir: Path) -> list[tuple[int, int]]:
    con = sqlite3.connect(f"file:{run_dir / 'ledger.sqlite'}?mode=ro", uri=True)
    try:
        return con.execute("SELECT epoch, sample FROM samples WHERE state='committed'").fetchall()
    except sqlite3.OperationalError:
        return []
    finally:
        con.close()


def _wait(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def loc(tmp_path):
    loc = Local(tmp_path)
    yield loc
    for p in loc.procs:  # a failed assertion must not leave a pipeline running
        if p.poll() is None:
            p.kill()
            p.wait()


def test_readme_prompts_command_writes_data_the_producer_reads(tmp_path, loc):
    from dflash.producers.data import open_dataset

    cmd = readme_commands()[ONE_GPU + 6]
    # the tiny random target seldom ends a turn: fewer prompts from more candidates; CPU
    cmd = cmd.replace("--count 20000", "--count 4 --max-tries 2000 --max-new-tokens 64").replace(" --gpu 0", "")
    r = loc.run(cmd)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["prompts"] == 4
    ds = open_dataset(tmp_path / "prompts.jsonl")
    assert len(ds) == 4 and all(ds.read(i).messages[0]["role"] == "user" for i in range(4))


@pytest.mark.slow
@pytest.mark.timeout(900)  # five processes start torch on two shared cores
def test_readme_story_runs_as_written(tmp_path, loc):
    cmds = dict(enumerate(readme_commands()))
    r = ONE_GPU + 6  # the "Real use" block
    broker_cmd, status_cmd, logs_cmd, plot_cmd, resume_cmd = (cmds[r + i] for i in (1, 6, 7, 8, 9))
    produce_cmds, consume_cmds = [cmds[r + 2], cmds[r + 3]], [cmds[r + 4], cmds[r + 5]]  # 2 and 2, one host
    procs = loc.procs
    procs.append(loc.start(broker_cmd))
    first = loc.wait_for_new_run(None)
    procs += [loc.start(c) for c in produce_cmds + consume_cmds]

    # live status while it trains
    _wait(lambda: len(_committed(first)) > 0, 300, "a first commit")  # 2 cores: 5 processes start torch
    st = loc.run(status_cmd)
    assert st.returncode == 0 and first.name in st.stdout, st.stdout + st.stderr

    # crash: every process killed at once, as a power cut would
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()
    done_before = set(_committed(first))
    assert 0 < len(done_before) < N_ROWS * EPOCHS

    # every peer of the first run was admitted under its default name: 2 producers, 2 consumers
    assert len({p.name for p in (first / "logs").glob("producer-*.jsonl")}) == 2
    assert len({p.name for p in (first / "logs").glob("consumer-*.jsonl")}) == 2
    # the producers answered the prompts themselves (--regenerate): what the consumers trained on
    lines = [json.loads(x) for f in (first / "logs").glob("producer-*.jsonl") for x in f.read_text().splitlines()
             if _is_json(x)]  # a SIGKILL may have torn a last line
    regen = [e for e in lines if e["event"] == "produce.regen"]
    assert sum(e["generated"] for e in regen) > 0, regen[:3]

    procs.clear()
    procs.append(loc.start(resume_cmd))
    second = loc.wait_for_new_run(first)
    procs += [loc.start(c) for c in produce_cmds + consume_cmds]  # as they were: the broker names the checkpoint
    for p in procs:
        p.wait(timeout=300)
    outs = [(p.out_path.read_text(), p.err_path.read_text()) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, (out + err)[-3000:]
    # stdout is the JSON log lines only (DFLASH_LOG_JSON): nothing else mixed in; and no
    # library noise on stderr either (progress bars, torchft's flight recorder, HTTP access lines)
    for p, (out, err) in zip(procs, outs):
        bad = [line for line in out.splitlines() if line.strip() and not _is_json(line)]
        assert not bad, f"{p.args[0]} printed non-JSON lines on stdout: {bad[:5]}"
        noise = [line for line in err.splitlines() if any(n in line for n in NOISE)]
        assert not noise, f"{p.args[0]} printed library noise: {noise[:5]}"
    assert json.loads((second / "run.json").read_text())["parent_run"] == first.name

    # exactly once across the crash: what the first run committed is never trained again
    after = _committed(second)
    assert len(after) == len(set(after))
    assert done_before.isdisjoint(after)
    assert done_before | set(after) == {(e, s) for e in range(EPOCHS) for s in range(N_ROWS)}

    logs = loc.run(logs_cmd, shell=True)
    assert logs.returncode == 0, logs.stderr
    lines = [json.loads(line) for line in logs.stdout.splitlines()]
    assert lines and set(lines[0]) == {"step", "loss", "acc", "streak", "tokens_per_s"}
    steps = [line["step"] for line in lines]
    assert len(steps) == len(set(steps)), "the jq recipe printed a step more than once"
    assert f"# run {second.name}" in logs.stderr  # it says which run it shows

    plot = loc.run(plot_cmd)
    assert plot.returncode == 0, plot.stdout + plot.stderr
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(600)
def test_readme_one_gpu_path_runs_as_written(tmp_path, loc):
    """The "One GPU, ten minutes" block as written, on CPU: a one-minute budget instead of eight,
    the bundled chats' first requests for the prompts the target would write."""
    prompts_cmd, broker_cmd, produce_cmd, consume_cmd, export_cmd, eval_cmd = readme_commands()[ONE_GPU:ONE_GPU + 6]
    assert "--holdout 8" in prompts_cmd and "--time-budget 7m30s" in broker_cmd  # the run the README describes
    rows = (tmp_path / "prompts.jsonl").read_text().splitlines()
    (tmp_path / "prompts.jsonl").write_text("".join(x + "\n" for x in rows[:-4]))
    (tmp_path / "prompts.holdout.jsonl").write_text("".join(x + "\n" for x in rows[-4:]))
    loc.env.update(DFLASH_BROKER=f"tcp://127.0.0.1:{loc.port}", DFLASH_EVAL_MAX_NEW_TOKENS="24")
    budget_s = 60
    procs = loc.procs
    t0 = time.monotonic()
    procs.append(loc.start(broker_cmd.replace("--time-budget 7m30s", f"--time-budget {budget_s}s")))
    run = loc.wait_for_new_run(None)
    procs += [loc.start(produce_cmd), loc.start(consume_cmd)]
    for p in procs:
        p.wait(timeout=budget_s + 240)
    took = time.monotonic() - t0
    for p in procs:
        assert p.returncode == 0, (p.out_path.read_text() + p.err_path.read_text())[-3000:]
    # it ended by itself, on time (the broker's reserve covers the last checkpoint and commit)
    assert took < budget_s + 30, took
    consumer = [json.loads(x) for f in (run / "logs").glob("consumer-*.jsonl") for x in f.read_text().splitlines()
                if _is_json(x)]
    end = [e for e in consumer if e["event"] == "train.end"][-1]
    # annealed: the schedule follows the broker's clock to its deadline, so the last step's lr
    # is within 1% of the peak's way down to --min-lr 0 (its progress just under 1)
    lr_max = max(e["lr"] for e in consumer if e["event"] == "train.step")
    assert end["reason"] == "end_of_stream" and end["lr"] <= 0.01 * lr_max, (end, lr_max)
    assert not [e for e in consumer if e["event"] == "train.unannealed"]
    committed = _committed(run)
    assert len(committed) == len(set(committed)) == end["samples"] > 0  # everything trained, committed once

    exp = loc.run(export_cmd)
    assert exp.returncode == 0, exp.stdout + exp.stderr
    assert (tmp_path / "drafter" / "config.json").exists()
    ev = loc.run(eval_cmd)
    assert ev.returncode == 0, ev.stdout + ev.stderr
    assert "tau" in ev.stdout and "speedup" in ev.stdout, ev.stdout
