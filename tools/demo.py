"""dflash-demo: the whole pipeline on this machine in one command.

A real broker, producers and consumers, each its own process, on real sockets on
loopback, on CPU: a tiny target built locally from a config (cached after the first
build) and the bundled sample chats. Shows progress, ends with a summary. Ctrl-C stops
every child cleanly.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from dflash.protocol.sockets import free_port_block
from dflash.runtime.command_line import command, fail, option
from dflash.runtime.run import resolve_run, runs_root

from .procs import ProcessGroup, tail_lines
from .summary import render, summarise


def _sample_data() -> Path:
    import dflash.producers.sample_data as pkg

    return Path(pkg.__file__).resolve().parent / "chats.jsonl"



def _cli(name: str) -> list[str]:
    """Run our console scripts through this interpreter, so the demo works from any venv."""
    module = {"broker": "dflash.broker.broker_command", "produce": "dflash.producers.produce_command",
              "consume": "dflash.consumers.process.consume_command"}[name]
    return [sys.executable, "-m", module]


def _wait_for_run(broker_out: Path, deadline: float, group: ProcessGroup) -> str:
    offset = 0
    while time.monotonic() < deadline:
        lines, offset = tail_lines(broker_out, offset)
        for line in lines:
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if ev.get("run_id"):
                return ev["run_id"]
        if group.failed():
            break
        time.sleep(0.1)
    raise RuntimeError(f"the broker did not start; see {broker_out}")


def _progress(ev: dict, t0: float) -> str:
    q = ev.get("queue") or {}
    q_pre = list((q.get("q_pre") or {}).values())
    qs = f" q_pre={q_pre} q_hs={q.get('q_hs')}" if q else ""
    eta = f" ETA={ev['eta_s']}s" if ev.get("eta_s") is not None else ""
    return (f"[{(time.monotonic() - t0) / 60:4.1f}m] step={ev['step']} loss={ev.get('loss')} acc={ev.get('acc')} "
            f"streak={ev.get('streak')} lr={ev.get('lr', 0):.2e} | {ev.get('tokens_per_s', 0) / 1000:.1f}Ktok/s"
            f"{qs} | epoch~{ev.get('epoch')}{eta}")


@command("DEMO")
@option("--runs-dir", default="runs", type=click.Path(file_okay=False), help="Root folder of run folders.")
@option("--producers", default=2, type=click.IntRange(1, 8), help="Target producer processes.")
@option("--consumers", default=2, type=click.IntRange(1, 8), help="Drafter consumer processes (data-parallel ranks).")
@option("--epochs", default=5, type=click.IntRange(1), help="Passes over the bundled dataset.")
@option("--target", default=None, help="Target model folder (default: a tiny model built locally, cached).")
@option("--data", default=None, help="Dataset (default: the bundled sample chats).")
@option("--block-size", default=8, type=click.IntRange(2), help="DFlash block size (small for a CPU demo).")
@option("--anchors", default=48, type=click.IntRange(1), help="Anchors per sequence (small for a CPU demo).")
@option("--draft-layers", default=2, type=click.IntRange(1), help="Draft decoder layers (small for a CPU demo).")
@option("--lr", default=3e-3, type=float, help="Peak learning rate (high for a short demo).")
@option("--time-limit-s", default=600, type=int, help="Stop everything after this many seconds.")
def main(runs_dir, producers, consumers, epochs, target, data, block_size, anchors, draft_layers, lr, time_limit_s):
    """Run broker + producers + consumers locally on CPU and summarise the run."""
    from .tiny import tiny_target

    target = target or str(tiny_target())
    data = data or str(_sample_data())
    base = free_port_block(2 + consumers + 2)
    broker = f"tcp://127.0.0.1:{base}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASH_LOG_JSON": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("DFLASH_") or k == "DFLASH_LOG_JSON"}
    root = runs_root(runs_dir)
    root.mkdir(parents=True, exist_ok=True)
    group = ProcessGroup()
    t0 = time.monotonic()
    deadline = t0 + time_limit_s
    pending = root / f".demo-{os.getpid()}"
    try:
        group.start("broker", _cli("broker") + [
            "--bind", "127.0.0.1", "--port", str(base), "--data-in-port", str(base + 1),
            "--data-out-ports", f"{base + 2}-{base + 2 + consumers + 1}", "--runs-dir", runs_dir,
            "--epochs", str(epochs), "--consumers", str(consumers), "--heartbeat-s", "0.5",
            "--timeout-s", "20", "--lease-size", "32"], pending / "broker.out", env)
        run_id = _wait_for_run(pending / "broker.out", deadline, group)
        run_dir = root / run_id
        click.echo(f"run {run_id}: broker at {broker}, {producers} producers, {consumers} consumers (CPU)")
        click.echo(f"  target {target}\n  data   {data}\n  logs   {run_dir / 'logs'}/")
        for i in range(producers):
            group.start(f"producer-{i}", _cli("produce") + [
                "--broker", broker, "--runs-dir", runs_dir, "--instance", f"demo-p{i}", "--device", "cpu",
                "--target", target, "--data", data, "--token-budget", "2048", "--max-batch-size", "16", "--max-length", "512",
                "--lease-size", "32", "--prefetch", "2"], run_dir / "stdout" / f"producer-{i}.out", env)
        for i in range(consumers):
            group.start(f"consumer-{i}", _cli("consume") + [
                "--broker", broker, "--runs-dir", runs_dir, "--instance", f"demo-c{i}", "--target", target,
                "--block-size", str(block_size), "--anchors", str(anchors), "--draft-layers", str(draft_layers),
                "--lr", str(lr), "--save-every", "0"],
                run_dir / "stdout" / f"consumer-{i}.out", env)
        _watch(group, run_dir, t0, deadline)
    except KeyboardInterrupt:
        click.echo("\nCtrl-C: stopping every process (SIGTERM, then SIGKILL after 20 s) ...")
        group.stop()
        click.echo("stopped.")
        sys.exit(130)
    except RuntimeError as e:
        group.stop()
        fail(str(e), 1)
    finally:
        _move_broker_out(pending, root)
    _finish(group, run_dir)


def _watch(group: ProcessGroup, run_dir: Path, t0: float, deadline: float) -> None:
    """Print rank 0's progress every ~2 s until every process has exited."""
    offsets: dict[Path, int] = {}
    last_print = 0.0
    latest = None
    while not group.all_exited():
        if time.monotonic() > deadline:
            group.stop()
            raise RuntimeError(f"time limit reached; stopped every process (logs in {run_dir / 'logs'})")
        bad = group.failed()
        if bad:
            group.stop()
            names = ", ".join(f"{c.name} (exit {c.proc.returncode}, output {c.out_path})" for c in bad)
            raise RuntimeError(f"failed: {names}")
        for p in (run_dir / "logs").glob("consumer-*.jsonl"):
            lines, offsets[p] = tail_lines(p, offsets.get(p, 0))
            for line in lines:
                ev = json.loads(line)
                if ev.get("event") == "train.step" and ev.get("rank", 0) == 0:
                    latest = ev
        if latest and time.monotonic() - last_print > 2:
            click.echo(_progress(latest, t0))
            last_print = time.monotonic()
        time.sleep(0.2)


def _move_broker_out(pending: Path, root: Path) -> None:
    """The broker's stdout is written before the run ID exists; file it under its run."""
    out = pending / "broker.out"
    if not out.exists():
        return
    try:
        run_dir = resolve_run(_first_run_id(out), root)
        (run_dir / "stdout").mkdir(exist_ok=True)
        os.replace(out, run_dir / "stdout" / "broker.out")
        pending.rmdir()
    except (FileNotFoundError, ValueError, OSError):
        pass


def _first_run_id(path: Path) -> str:
    for line in path.read_text(errors="replace").splitlines():
        try:
            rid = json.loads(line).get("run_id")
        except json.JSONDecodeError:
            continue
        if rid:
            return rid
    raise ValueError("no run ID in broker output")


def _finish(group: ProcessGroup, run_dir: Path) -> None:
    s = summarise(run_dir)
    click.echo("\n" + render(s))
    (run_dir / "summary.json").write_text(json.dumps(s, indent=2))


if __name__ == "__main__":
    main()
