"""Elastic drafters (issue 7, "Must show"): a real CPU pipeline (broker, 2 producers,
3 consumers of `dflash-broker --consumers 3`, each its own process on loopback, meeting
through the broker's torchft lighthouse). One consumer is SIGKILLed mid-run; the other
two go on from the same step without a restart of the job; the operator restarts the
killed one once the broker has declared it lost, and it rejoins (healed from a survivor)
and trains. The run finishes by itself.

Checked from what the run left on disk (logs, ledger, final checkpoint):
- survivors' step numbers never go back: each committed step is the one before plus one,
  across the kill (a dropped step in flight is logged and retried with the same number);
- exactly-once: every (epoch, sample) committed once in the ledger and trained once in the
  final checkpoint's record; the final checkpoint loads;
- the restarted consumer logged its join (a quorum of 3, healed at a step > 0) and steps.

The victim is rank 0 by default (the rank that checkpoints and commits: the role moves to
the lowest survivor, then back to the rejoined rank 0); DFLASH_ELASTIC_VICTIM=1 or 2 kills
another. DFLASH_LONG=1: more data (400 samples x 4 epochs), the kill later in the run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from tests.reliability.chaos_audit import audit

from dflash.consumers.process.join import ELASTIC_COLLECTIVE_TIMEOUT_S
from tests.reliability.chaos_pipeline import Pipeline

pytestmark = pytest.mark.integration

LONG = os.environ.get("DFLASH_LONG") == "1"
N_ROWS = 400 if LONG else 320
EPOCHS = 4 if LONG else 2
KILL_AT_STEP = 40 if LONG else 6  # the victim's committed step when it is killed
VICTIM = int(os.environ.get("DFLASH_ELASTIC_VICTIM", "0"))
DEADLINE_S = (600 if LONG else 300) + ELASTIC_COLLECTIVE_TIMEOUT_S  # room for one hung collective


def _events(path: Path) -> list[dict]:
    """A live JSON-lines log, whole lines only (the last may be half-written)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def _wait(pred, timeout_s: float, what: str, pipe: Pipeline):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        bad = {n: c for n, c in pipe.exited().items() if c != 0}
        assert not bad, f"while waiting for {what}: exited {bad}: {[pipe.tail(n) for n in bad]}"
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def _ranks(log_of: dict[str, Path]) -> dict[str, int] | None:
    """Consumer -> the rank the broker gave it (train.start), once all have started."""
    starts = {n: next((e["rank"] for e in _events(p) if e["event"] == "train.start"), None) for n, p in log_of.items()}
    return starts if None not in starts.values() else None


def _start_group(pipe: Pipeline, n: int, wait_s: float) -> tuple[str, Path, dict[str, Path], dict[str, int]]:
    """Start the pipeline with its elastic group of `n` consumers (c0-g1, ...) and wait for
    their ranks: (run ID, the run's log folder, consumer -> its log, consumer -> its rank)."""
    run = pipe.start_all(None, 1)
    logs = pipe.runs / run / "logs"
    log_of = {f"c{i}-g1": logs / f"consumer-c{i}-g1.jsonl" for i in range(n)}
    return run, logs, log_of, _wait(lambda: _ranks(log_of), wait_s, "the consumers' broker ranks", pipe)


def _steps(ev: list[dict]) -> list[int]:
    return [e["step"] for e in ev if e["event"] == "train.step"]


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_S + 120)
def test_three_consumers_one_killed_survivors_go_on_and_it_rejoins(tmp_path):
    pipe = Pipeline(tmp_path, n_rows=N_ROWS, epochs=EPOCHS, seed=7, consumers=3)
    t0 = time.monotonic()
    try:
        run, logs, log_of, rank = _start_group(pipe, 3, 120)
        names = list(log_of)
        victim = next(n for n in names if rank[n] == VICTIM)
        survivors = [n for n in names if n != victim]

        _wait(lambda: any(s >= KILL_AT_STEP for s in _steps(_events(log_of[victim]))), 180,
              f"{victim} at step {KILL_AT_STEP}", pipe)
        pipe.kill(victim)
        t_kill = time.time()
        before = {n: max(_steps(_events(log_of[n]))) for n in survivors}
        print(f"\nSIGKILL {victim} at its step {max(_steps(_events(log_of[victim])))}; survivors at {before}")

        # The survivors go on without it: a quorum of 2, then steps beyond where they were. Usually
        # within seconds; a survivor left hanging in a collective joins after its timeout
        # (docs/RELIABILITY.md section 8, Limits), and the other outwaits it.
        for n in survivors:
            _wait(lambda n=n: any(e["event"] == "train.quorum" and e["world_size"] == 2 and e["step"] >= before[n]
                                  for e in _events(log_of[n])),
                  ELASTIC_COLLECTIVE_TIMEOUT_S + 60, f"{n} in a quorum of 2", pipe)
            _wait(lambda n=n: max(_steps(_events(log_of[n]))) > before[n] + 1, 60, f"{n} stepping on", pipe)
        broker_log = logs / "broker-main.jsonl"
        _wait(lambda: any(e["event"] == "broker.peer_lost" and e.get("peer_instance") == victim
                          for e in _events(broker_log)), 60, f"the broker declaring {victim} lost", pipe)

        # The operator restarts it (another instance name: its own log file); it rejoins.
        back = f"{victim.split('-')[0]}-back"
        pipe.start_consumer(back)
        log_of[back] = logs / f"consumer-{back}.jsonl"
        _wait(lambda: _steps(_events(log_of[back])), 120, f"{back} training", pipe)
        t_back = time.time()

        _wait(lambda: "broker" in pipe.exited(), DEADLINE_S - (time.monotonic() - t0), "the run's end", pipe)
        assert pipe.exited()["broker"] == 0, pipe.tail("broker")
        assert pipe.wait_exit(list(pipe.procs), 60), f"peers still running after the broker ended: {pipe.exited()}"
        codes = pipe.exited()
        assert all(c == 0 for c in codes.values()), {n: pipe.tail(n) for n, c in codes.items() if c}
        assert pipe.run_json(run)["outcome"] == "completed"
    finally:
        pipe.close()
    wall = time.monotonic() - t0

    ev = {n: _events(p) for n, p in log_of.items()}
    # Survivors: every committed step is the previous one plus one, through the kill.
    for n in survivors:
        steps = _steps(ev[n])
        assert steps == list(range(steps[0], steps[0] + len(steps))), (n, steps)
        assert steps[-1] > before[n], (n, before[n], steps[-1])
    dropped = {n: _dropped_in_flight(ev[n]) for n in survivors}
    # The restarted consumer joined a quorum of 3, was healed to a live step, and trained.
    healed = [e for e in ev[back] if e["event"] == "train.healed"]
    assert healed and healed[0]["step"] > 0, ev[back][-5:]
    assert any(e["event"] == "train.quorum" and e["world_size"] == 3 for e in ev[back])
    back_steps = _steps(ev[back])
    assert back_steps and back_steps[0] > healed[0]["step"] and back_steps == sorted(set(back_steps))
    # Everyone ended on the same step.
    ends = {n: next(e for e in ev[n] if e["event"] == "consume.done")["step"] for n in [*survivors, back]}
    assert len(set(ends.values())) == 1, ends

    a = audit(pipe.runs, pipe.chain, EPOCHS, N_ROWS)
    print(f"survivors' steps: {[(n, _steps(ev[n])[0], _steps(ev[n])[-1]) for n in survivors]} (no rollback); "
          f"dropped steps in flight: {dropped}")
    print(f"{back} healed at step {healed[0]['step']} ({t_back - t_kill:.1f}s after the kill), trained steps "
          f"{back_steps[0]}..{back_steps[-1]}; final step {ends}")
    print(f"samples lost: {len(a.lost)}, samples duplicated: {len(a.duplicated)}, committed "
          f"{sum(a.ledger.values())}/{len(a.expected)}, in the final weights {sum(a.record.values())}; "
          f"wall {wall:.0f}s")
    assert len(pipe.chain) == 1  # one run: no restart of the job
    assert not a.lost, sorted(a.lost)[:20]
    assert not a.duplicated, sorted(a.duplicated)[:20]
    assert not a.unexpected, sorted(a.unexpected)[:20]
    assert a.record_complete
    _loads(a.final_checkpoint)


def _dropped_in_flight(ev: list[dict]) -> list[int]:
    """The steps a consumer dropped; each must be the one in flight (its last committed
    step plus one), never a step it had committed: no rollback."""
    last, out = None, []
    for e in ev:
        if e["event"] == "train.step":
            last = e["step"]
        elif e["event"] == "train.step_dropped":
            assert last is None or e["step"] == last + 1, (e, last)
            out.append(e["step"])
    return out


def _loads(path: Path) -> None:
    """The final checkpoint loads into a drafter with the consumer's own loader."""
    import torch

    from dflash.consumers.checkpoints.checkpoint import load_checkpoint
    from dflash.consumers.drafter.model import DFlashDraft, DrafterConfig
    from dflash.runtime.target_heads import load_target_heads
    from dflash.tools.tiny import tiny_target

    heads = load_target_heads(tiny_target(), dtype=torch.float32)
    state = json.loads((path / "state.json").read_text())
    model = DFlashDraft(DrafterConfig.from_target(heads.spec, 1, len(state["signal"]["target_layers"])))
    saved, rng = load_checkpoint(path, model, torch.optim.AdamW(model.parameters()))
    assert saved["step"] == state["step"] and len(rng) == state["world_size"] >= 1
