"""A real CPU pipeline (broker, producers, data-parallel consumers as processes on
loopback) with an operator's hands: start it, SIGKILL a process, restart what an
operator would. Used by test_chaos.py; the exactly-once checks live in chaos_audit.py.

Every process started here is remembered and killed by `close()`, whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


from tests.harness.broker import ask_status
from dflash.protocol.sockets import free_port_block

N_OUT = 8  # data-out ports: rotated through as consumers come and go


def _below_ephemeral(n: int) -> int:
    """A block of `n` free ports below the kernel's ephemeral range: the broker binds them
    again after each restart, and a port in that range may meanwhile be taken as the source
    port of some other connection on the host (a resumed broker then failed to bind)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        base = free_port_block(n)
        if base + n <= low:
            return base
    return free_port_block(n)


class Pipeline:
    def __init__(self, tmp: Path, *, n_rows: int, epochs: int, seed: int, consumers: int = 2,
                 timeout_s: float = 3.0, save_every: int = 2, broker_args: tuple = (), start_s: float = 60.0):
        from dflash.tools.tiny import tiny_target

        import dflash.producers.sample_data as sample_data

        self.tmp, self.epochs, self.seed, self.n_consumers = tmp, epochs, seed, consumers
        self.timeout_s, self.save_every, self.broker_args = timeout_s, save_every, list(broker_args)
        self.start_s = start_s  # how long a starting broker may take to answer status
        rows = (Path(sample_data.__file__).parent / "chats.jsonl").read_text().splitlines()[:n_rows]
        assert len(rows) == n_rows
        self.data = tmp / "chats.jsonl"
        self.data.write_text("\n".join(rows) + "\n")
        self.target, self.runs = str(tiny_target()), tmp / "runs"
        self.out = tmp / "out"
        self.out.mkdir(exist_ok=True)
        self.port = _below_ephemeral(2 + N_OUT)  # the same ports for every restart, as an operator's
        self.control = f"tcp://127.0.0.1:{self.port}"
        # One torch thread per process: several processes share two cores. Nothing from the
        # developer's DFLASH_* environment: every option is on the command line.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
        self.env.update(OMP_NUM_THREADS="1", DFLASH_LOG_JSON="1")
        self.procs: dict[str, subprocess.Popen] = {}  # live name -> process
        self.everything: list[subprocess.Popen] = []  # for close()
        self.chain: list[str] = []  # run IDs, oldest first
        self.serial = 0

    # ------------------------------------------------------------ starting

    def _spawn(self, name: str, module: str, args: list[str]) -> subprocess.Popen:
        self.serial += 1
        with open(self.out / f"{self.serial:03d}-{name}.out", "w") as f:  # a file: nobody has to drain a pipe
            p = subprocess.Popen([sys.executable, "-m", module, *args], stdout=f, stderr=subprocess.STDOUT,
                                 env=self.env, cwd=self.tmp)
        p.name, p.log = name, f.name
        self.procs[name] = p
        self.everything.append(p)
        return p

    def start_broker(self, resume: str | None) -> str | None:
        """A broker (resuming `resume` if given); its run ID once it answers status, or
        None when the resume is refused because the chain committed everything."""
        p = self.port
        args = ["--bind", "127.0.0.1", "--port", str(p), "--data-in-port", str(p + 1),
                "--data-out-ports", f"{p + 2}-{p + 1 + N_OUT}", "--runs-dir", str(self.runs),
                "--consumers", str(self.n_consumers), "--heartbeat-s", "0.5", "--timeout-s", f"{self.timeout_s:g}",
                "--lease-size", "8", "--drain-s", "30", *self.broker_args]
        args += ["--resume", resume] if resume else ["--epochs", str(self.epochs), "--seed", str(self.seed)]
        proc = self._spawn("broker", "dflash.broker.broker_command", args)
        end = time.monotonic() + self.start_s
        while time.monotonic() < end:
            if proc.poll() is not None:
                text = Path(proc.log).read_text()
                if resume and proc.returncode == 2 and "nothing is left to train" in text:
                    del self.procs["broker"]
                    return None
                raise AssertionError(f"broker exited {proc.returncode}: {text[-2000:]}")
            st = ask_status(self.control, 0.5)
            if st is not None:
                self.chain.append(st["run_id"])
                return st["run_id"]
        raise AssertionError(f"broker did not answer status within {self.start_s:g} s")

    def start_producer(self, name: str) -> subprocess.Popen:
        return self._spawn(name, "dflash.producers.produce_command", [
            "--broker", self.control, "--runs-dir", str(self.runs), "--instance", name, "--device", "cpu",
            "--target", self.target, "--data", str(self.data), "--token-budget", "512", "--max-length", "512",
            "--max-batch-size", "2", "--lease-size", "8", "--prefetch", "2"])

    def start_consumer(self, name: str) -> subprocess.Popen:
        # No --resume: in a resumed run the broker names the checkpoint (PROTOCOL.md 8).
        return self._spawn(name, "dflash.consumers.process.consume_command", [
            "--broker", self.control, "--runs-dir", str(self.runs), "--instance", name, "--target", self.target,
            "--block-size", "8", "--anchors", "48", "--draft-layers", "1", "--lr", "3e-3", "--save-every", str(self.save_every),
            "--log-position-every", "0"])

    def start_all(self, resume: str | None, gen: int) -> str | None:
        run = self.start_broker(resume)
        if run is not None:
            for i in range(2):
                self.start_producer(f"p{i}-g{gen}")
            for i in range(self.n_consumers):
                self.start_consumer(f"c{i}-g{gen}")
        return run

    # ------------------------------------------------------------ watching

    def status(self) -> dict | None:
        return ask_status(self.control, 0.5) if self.alive("broker") else None

    def alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def live(self, role: str) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is None and (n == role or n[0] == role[0])]

    def exited(self) -> dict[str, int]:
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def joined(self, name: str) -> bool:
        """`name` got a welcome from the newest run (its log file is in that run's folder)."""
        return any((self.runs / self.chain[-1] / "logs").glob(f"*-{name}.jsonl"))

    def drop_late_joiners(self) -> list[str]:
        """After the broker ended: kill the peers that never joined its run (started by the
        operator just before the end; they would wait for a broker that is gone)."""
        late = [n for n, p in self.procs.items() if not self.joined(n) and n != "broker"]
        for n in late:
            p = self.procs.pop(n)
            p.kill()
            p.wait(10)
        return late

    def run_json(self, run_id: str) -> dict:
        return json.loads((self.runs / run_id / "run.json").read_text())

    def tail(self, name: str, n: int = 1500) -> str:
        """The end of the newest process named `name`'s output (live or not)."""
        p = next((p for p in reversed(self.everything) if p.name == name), None)
        return Path(p.log).read_text()[-n:] if p is not None else ""

    # ------------------------------------------------------------ operator's hands

    def kill(self, name: str) -> None:
        """SIGKILL `name`; it leaves the live set (its exit code -9 is expected)."""
        p = self.procs.pop(name)
        p.send_signal(signal.SIGKILL)
        p.wait(10)

    def pause(self, name: str, paused: bool = True) -> None:
        """SIGSTOP (or SIGCONT) `name`: frozen, it sends nothing, as a hung host would."""
        self.procs[name].send_signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def wait_exit(self, names: list[str], timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if not any(self.alive(n) for n in names):
                return True
            time.sleep(0.1)
        return False

    def stop_rest(self, grace_s: float = 40.0) -> dict[str, int]:
        """What an operator does before restarting everything: SIGTERM whatever still runs
        (the broker first: it tells its peers to stop and records their last commits),
        wait, SIGKILL what did not go. Returns the exit codes of this generation."""
        order = ["broker"] + [n for n in self.procs if n != "broker"]
        for n in order:
            if self.alive(n):
                self.procs[n].send_signal(signal.SIGTERM)
        if not self.wait_exit(list(self.procs), grace_s):
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        codes = self.exited()
        self.procs = {}
        return codes

    def close(self) -> None:
        """Kill every process this pipeline ever started that still runs."""
        for p in self.everything:
            if p.poll() is None:
                p.kill()
        for p in self.everything:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
