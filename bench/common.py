"""Shared by the bench/ scripts: the machine they ran on, batches shaped like a producer's,
a real `dflash-broker` subprocess, per-process CPU time, and table/JSON output.

The scripts are run as files (`python bench/transport.py`), so bench/ is on sys.path and
`import common` finds this module; the project itself is imported as `dflash.*`.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import zmq
from dflash.protocol.sockets import free_port_block

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"

# Qwen3-8B capture: 5 layers x 4096 hidden, bf16 (hidden size x layers x 2
# bytes: 40 KiB per token). Batch sizes in the tables are MiB of tensor payload.
HIDDEN, N_LAYERS = 4096, 5
LAYER_IDS = [1, 9, 17, 25, 33]
BYTES_PER_TOKEN = N_LAYERS * HIDDEN * 2 + 4 + 1  # hidden bf16 + input_ids int32 + loss_mask uint8


def machine() -> dict:
    """What a reader needs to compare numbers across machines."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    mem_kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return {"nproc": os.cpu_count(), "cpu": cpu, "ram_gib": round(mem_kib / 2**20, 1),
            "python": platform.python_version(), "torch": torch.__version__, "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(), "kernel": platform.release(),
            "loadavg_at_start": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def batch_tensors(mib: float) -> dict:
    """input_ids, loss_mask, hidden [T, 5*4096] bf16 totalling about `mib` MiB (as producers send)."""
    import torch

    T = max(1, int(mib * 2**20) // BYTES_PER_TOKEN)
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, 151936, (T,), dtype=torch.int32, generator=g),
            "loss_mask": torch.ones(T, dtype=torch.uint8),
            "hidden": torch.randn(T, N_LAYERS * HIDDEN, generator=g).to(torch.bfloat16)}


def payload_bytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def proc_cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds of a live process (all threads), or of one of its threads, from /proc."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = open(path).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_names(pid: int) -> dict[int, str]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
        except FileNotFoundError:
            pass
    return out


class CpuSampler:
    """Samples processes' CPU seconds every `every_s` on a thread, so the CPU a process spent
    inside a receiver's timed window (perf_counter, the same clock in every process) can
    be read afterwards, without start-up, warm-up or shutdown in it. Threads of processes
    watched with `threads=True` are sampled one by one: the busiest thread of a relay is
    its bottleneck once it has a core to itself."""

    def __init__(self, every_s: float = 0.01):
        self.samples: dict[tuple, list[tuple[float, float]]] = {}
        self.names: dict[tuple, str] = {}
        self._pids: dict[int, bool] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._every = every_s

    def watch(self, *pids: int, threads: bool = False) -> "CpuSampler":
        for p in pids:
            self._pids[p] = threads
        if not self._thread.is_alive():
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid, threads in list(self._pids.items()):
                try:
                    t = time.perf_counter()
                    self.samples.setdefault((pid,), []).append((t, proc_cpu_s(pid)))
                    if threads:
                        for tid, name in thread_names(pid).items():
                            self.names[(pid, tid)] = name
                            self.samples.setdefault((pid, tid), []).append((t, proc_cpu_s(pid, tid)))
                except (FileNotFoundError, ProcessLookupError):
                    self._pids.pop(pid, None)
            time.sleep(self._every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def busy(self, pid: int, t0: float, t1: float, tid: int | None = None) -> float | None:
        """Cores `pid` (or its thread `tid`) kept busy between perf_counter times t0 and t1."""
        key = (pid,) if tid is None else (pid, tid)
        s = [(t, c) for t, c in self.samples.get(key) or [] if t0 <= t <= t1]
        if len(s) < 2 or s[-1][0] - s[0][0] < 0.05:
            return None  # too short a window to say
        return (s[-1][1] - s[0][1]) / (s[-1][0] - s[0][0])

    def busiest_thread(self, pid: int, t0: float, t1: float) -> tuple[str, float] | None:
        """(name, cores) of the thread of `pid` that was busiest between t0 and t1."""
        top = self.busiest_threads(pid, t0, t1, 1)
        return top[0] if top else None

    def busiest_threads(self, pid: int, t0: float, t1: float, n: int = 4) -> list[tuple[str, float]]:
        """The `n` busiest threads of `pid` between t0 and t1, busiest first: (name, cores)."""
        found = [(self.busy(pid, t0, t1, k[1]) or 0.0, self.names[k]) for k in self.samples if len(k) == 2
                 and k[0] == pid]
        return [(name, round(cores, 3)) for cores, name in sorted(found, reverse=True)[:n]]




def command_path(name: str) -> str:
    """A console script (`dflash-broker`, ...) beside this Python, else on PATH (pip may
    put scripts elsewhere, as on the GPU machine's image)."""
    import shutil

    here = Path(sys.executable).with_name(name)
    return str(here) if here.exists() else (shutil.which(name) or name)


BROKER_CMD = [sys.executable, "-m", "dflash.broker.broker_command"]  # what `dflash-broker` runs
# DFLASH_BENCH_PROFILE=DIR: the broker runs under cProfile and the bench peers profile
# their link's I/O thread and main thread (bench/profile_top.py prints where time went).
# Profiling slows Python ~2x: for the split of time, never for the rates.
PROFILE_DIR = os.environ.get("DFLASH_BENCH_PROFILE")


def broker_cmd(port: int) -> list[str]:
    if not PROFILE_DIR:
        return BROKER_CMD
    return [sys.executable, "-m", "cProfile", "-o", f"{PROFILE_DIR}/broker-{port}.prof", "-m", "dflash.broker.broker_command"]


class Broker:
    """A real `dflash-broker` process on loopback, as a deployment runs it."""

    def __init__(self, runs_dir: Path, n_out: int, *args: str):
        self.port = free_port_block(2 + n_out)
        self.control = f"tcp://127.0.0.1:{self.port}"
        cmd = [*broker_cmd(self.port), "--bind", "127.0.0.1", "--port", str(self.port),
               "--data-in-port", str(self.port + 1), "--data-out-ports", f"{self.port + 2}-{self.port + 1 + n_out}",
               "--runs-dir", str(runs_dir), "--progress-s", "3600", "--log-level", "warning", *args]
        runs_dir.mkdir(parents=True, exist_ok=True)
        self.stderr = runs_dir / f"broker-{self.port}.stderr"
        with open(self.stderr, "w") as err:  # a file, not a pipe nobody reads
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **ENV})
        self._wait_up()

    def _wait_up(self, timeout_s: float = 30.0) -> None:
        ctx = zmq.Context.instance()
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited {self.proc.returncode}: {self.stderr.read_text()[-2000:]}")
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.control)
            s.send(msgpack.packb({"v": 1, "type": "status"}))
            ok = s.poll(500)
            s.close()
            if ok:
                return
        raise RuntimeError("broker did not answer status")

    def wait(self, timeout_s: float = 60.0) -> int:
        """Exit status, once the broker has ended the run. Raises on a hang."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise RuntimeError("broker did not exit after end of stream") from None

    def why(self) -> str:
        """The broker's side of a failure: exit status and the end of its stderr."""
        state = "running" if self.proc.poll() is None else f"exited {self.proc.returncode}"
        return f"broker {state}; its stderr ends: {self.stderr.read_text()[-1500:]!r}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


# glibc serves allocations above 32 MiB with a fresh mmap, so every large received message
# costs page faults on first touch (a 256 MiB copy into fresh memory runs at ~1.3 GB/s here,
# into reused memory at ~5 GB/s). These tunables make malloc reuse heap memory instead.
MALLOC_REUSE = {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296:glibc.malloc.arena_max=1"}
ENV: dict[str, str] = {}  # extra environment for every process spawned (set by --malloc-reuse)


def spawn(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **ENV})


def result(proc: subprocess.Popen, timeout_s: float) -> dict:
    """The `RESULT {json}` line a bench peer printed; raises with its stderr if it failed."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise RuntimeError(f"{proc.args[:4]} timed out: {err[-1500:]}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{proc.args[:4]} exited {proc.returncode}: {err[-1500:]}")
    return json.loads([line for line in out.splitlines() if line.startswith("RESULT ")][-1][7:])


def table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    """A plain-text table: cols = [(key, heading)]."""
    cells = [[h for _, h in cols]] + [[_fmt(r.get(k)) for k, _ in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
