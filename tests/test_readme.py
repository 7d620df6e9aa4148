"""Every command in README.md runs, so the README cannot rot.

The commands are taken from the README's ```bash blocks and run as written, with only
the substitutions a one-machine CPU test needs (listed in SUBST and `_localise`): the
broker host becomes 127.0.0.1 on free ports, `--gpu N` becomes CPU, the Hugging Face
target becomes a tiny local one, `chats.jsonl` a small slice of the bundled chats, and
several consumers on one host get distinct instance names. Model sizes come through
environment variables (DFLASH_*), which every option reads. `pip install` is what CI
runs first, `python -m pytest -q` is this suite, and `dflash-demo` runs in test_demo.py.

The scenario is the README's own story: start a run, look at it with dflash-status,
crash everything with SIGKILL, resume, finish, read the logs with jq, plot.
"""

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "broker"))
from broker_harness import free_port_block  # noqa: E402

from dflash.tools.tiny import tiny_target  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
N_ROWS, EPOCHS, CONSUMERS = 40, 6, 3
EXPECTED = [
    'pip install -e ".[test]"',
    "dflash-demo",
    "python -m pytest -q",
    "dflash-broker --epochs 6 --consumers 3",
    "dflash-produce --broker tcp://broker-host:5555 --gpu 0 --target Qwen/Qwen3-8B --data chats.jsonl",
    "dflash-consume --broker tcp://broker-host:5555 --gpu 5 --target Qwen/Qwen3-8B",
    "dflash-status --broker tcp://broker-host:5555",
    "dflash-logs --event train.step --json | jq -c '{step, loss, acc, streak, tokens_per_s}'",
    "dflash-plot --out training.png",
    "dflash-broker --resume runs/latest --consumers 3",
    "dflash-consume --broker tcp://broker-host:5555 --gpu 5 --target Qwen/Qwen3-8B --resume latest",
]


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
        self.target = str(tiny_target())
        import dflash.producers.sample_data as pkg

        rows = (Path(pkg.__file__).parent / "chats.jsonl").read_text().splitlines()[:N_ROWS]
        (tmp / "chats.jsonl").write_text("\n".join(rows) + "\n")
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")},
                    "OMP_NUM_THREADS": "1", "DFLASH_LOG_JSON": "1", "DFLASH_MAX_LENGTH": "512",
                    "DFLASH_TOKEN_BUDGET": "1024", "DFLASH_ANCHORS": "32", "DFLASH_BLOCK_SIZE": "8",
                    "DFLASH_DRAFT_LAYERS": "1", "DFLASH_SAVE_EVERY": "3", "DFLASH_HEARTBEAT_S": "0.5"}

    def argv(self, cmd: str) -> list[str]:
        cmd = cmd.replace("tcp://broker-host:5555", f"tcp://127.0.0.1:{self.port}")
        cmd = cmd.replace("--gpu 0", "--device cpu").replace("--gpu 5 ", "")
        cmd = cmd.replace("Qwen/Qwen3-8B", self.target)
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

    def start(self, cmd: str, instance: str | None = None) -> subprocess.Popen:
        env = dict(self.env, **({"DFLASH_INSTANCE": instance} if instance else {}))
        return subprocess.Popen(self.argv(cmd), cwd=self.tmp, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def run(self, cmd: str, shell: bool = False) -> subprocess.CompletedProcess:
        if shell:  # a pipeline, as a user types it
            return subprocess.run(cmd, shell=True, cwd=self.tmp, env=self.env, capture_output=True, text=True,
                                  timeout=60)
        return subprocess.run(self.argv(cmd), cwd=self.tmp, env=self.env, capture_output=True, text=True,
                              timeout=60)


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


@pytest.mark.slow
def test_readme_story_runs_as_written(tmp_path, loc):
    cmds = dict(enumerate(readme_commands()))
    broker_cmd, produce_cmd, consume_cmd, status_cmd, logs_cmd, plot_cmd, resume_cmd, consume_resume_cmd = (
        cmds[i] for i in range(3, 11))
    procs = loc.procs
    procs.append(loc.start(broker_cmd))
    first = loc.wait_for_new_run(None)
    procs.append(loc.start(produce_cmd))
    procs += [loc.start(consume_cmd, instance=f"c{i}") for i in range(CONSUMERS)]

    # live status while it trains
    _wait(lambda: len(_committed(first)) > 0, 120, "a first commit")
    st = loc.run(status_cmd)
    assert st.returncode == 0 and first.name in st.stdout, st.stdout + st.stderr

    # crash: every process killed at once, as a power cut would
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()
    done_before = set(_committed(first))
    assert 0 < len(done_before) < N_ROWS * EPOCHS

    procs.clear()
    procs.append(loc.start(resume_cmd))
    second = loc.wait_for_new_run(first)
    procs.append(loc.start(produce_cmd))
    procs += [loc.start(consume_resume_cmd, instance=f"c{i}") for i in range(CONSUMERS)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    assert json.loads((second / "run.json").read_text())["parent_run"] == first.name

    # exactly once across the crash: what the first run committed is never trained again
    after = _committed(second)
    assert len(after) == len(set(after))
    assert done_before.isdisjoint(after)
    assert done_before | set(after) == {(e, s) for e in range(EPOCHS) for s in range(N_ROWS)}

    logs = loc.run(logs_cmd, shell=True)
    assert logs.returncode == 0, logs.stderr
    lines = [json.loads(l) for l in logs.stdout.splitlines()]
    assert lines and set(lines[0]) == {"step", "loss", "acc", "streak", "tokens_per_s"}
    assert f"# run {second.name}" in logs.stderr  # it says which run it shows

    plot = loc.run(plot_cmd)
    assert plot.returncode == 0, plot.stdout + plot.stderr
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
