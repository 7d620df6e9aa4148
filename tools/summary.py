"""What a finished (or stopped) local run amounts to: read from its logs and its ledger."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from .runlogs import read_lines


def rank0_steps(run_dir: Path) -> list[dict]:
    steps = []
    for p in sorted((run_dir / "logs").glob("consumer-*.jsonl")):
        steps += [e for e in read_lines(p) if e.get("event") == "train.step" and e.get("rank", 0) == 0]
    return sorted(steps, key=lambda e: e["step"])


def ledger_counts(run_dir: Path) -> dict[str, int]:
    path = run_dir / "ledger.sqlite"
    if not path.exists():
        return {}
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return dict(con.execute("SELECT state, COUNT(*) FROM samples GROUP BY state").fetchall())
    finally:
        con.close()


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return ckpts[-1] if ckpts else None


def _mean(evs: list[dict], key: str) -> float | None:
    vals = [e[key] for e in evs if isinstance(e.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else None


def first_last(steps: list[dict], key: str, n: int = 5) -> tuple[float | None, float | None]:
    """Mean of the first and of the last `n` steps (one step is noisy; a few are not)."""
    n = max(1, min(n, len(steps) // 2))
    return _mean(steps[:n], key), _mean(steps[-n:], key)


def summarise(run_dir: Path) -> dict:
    steps = rank0_steps(run_dir)
    out = {
        "run_id": run_dir.name,
        "run_dir": str(run_dir),
        "steps": steps[-1]["step"] if steps else 0,
        "tokens": sum(e.get("tokens", 0) for e in steps),
        "samples": ledger_counts(run_dir),
        "checkpoint": str(latest_checkpoint(run_dir) or ""),
    }
    for key in ("loss", "acc", "streak"):
        out[f"{key}_first"], out[f"{key}_last"] = first_last(steps, key)
    return out


def render(s: dict) -> str:
    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "n/a"

    trained = s["samples"].get("committed", 0) + s["samples"].get("trained", 0)
    logs = Path(s["run_dir"]) / "logs"
    return "\n".join([
        f"run {s['run_id']}: {s['steps']} steps, {s['tokens']:,} tokens, {trained} samples trained "
        f"({s['samples'].get('committed', 0)} committed)",
        f"  loss   {f(s['loss_first'], '.4f')} -> {f(s['loss_last'], '.4f')}",
        f"  acc    {f(s['acc_first'], '.3f')} -> {f(s['acc_last'], '.3f')}",
        f"  streak {f(s['streak_first'], '.2f')} -> {f(s['streak_last'], '.2f')}",
        f"  checkpoint: {s['checkpoint'] or 'none'}",
        f"  logs:       {logs}/",
        "  try:",
        f"    jq -c 'select(.event==\"train.step\") | {{step, loss, acc, streak, tokens_per_s}}' {logs}/consumer-*.jsonl",
        f"    jq -c 'select(.level==\"warning\" or .level==\"error\")' {logs}/*.jsonl",
    ])
