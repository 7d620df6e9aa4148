"""Chaos (issue 7, "Must show"): a real CPU pipeline (broker, 2 producers, 2 gloo consumer
ranks on a tiny target, 2 epochs of bundled chats, a checkpoint every 2 steps) where
random processes, the broker at least once, are SIGKILLed at random moments and restarted
the way an operator would:

- a producer: started again, it joins the live run (the broker gave its leases back);
- a consumer: the other one goes on (elastic consumers, docs/RELIABILITY.md 8); once the
  broker has declared the dead one lost, it is started again and rejoins the live run;
- the broker: every peer exits non-zero; everything is restarted with `--resume`.

At the end, from the chain of ledgers and the final checkpoint's record of what its
weights were trained on: every (epoch, sample) trained exactly once in the committed
state, none lost, none duplicated; the final checkpoint loads.

Short form by default (3 kills); DFLASH_CHAOS_KILLS=N or DFLASH_LONG=1 (10 kills, more
data) for longer runs by hand; DFLASH_CHAOS_SEED replays a run (the seed is printed).
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter

import pytest
from chaos_audit import audit
from chaos_pipeline import Pipeline

LONG = os.environ.get("DFLASH_LONG") == "1"
KILLS = int(os.environ.get("DFLASH_CHAOS_KILLS", "10" if LONG else "3"))
N_ROWS = 400 if LONG or KILLS > 3 else 200
EPOCHS = 2
DEADLINE_S = 240 + 80 * KILLS  # the whole test, restarts included; fails beyond it
ROLES = ("broker", "producer", "consumer")


def _plan(rng: random.Random, kills: int) -> list[str]:
    """Victim roles in order; the broker at least once."""
    plan = [rng.choice(ROLES) for _ in range(kills)]
    if "broker" not in plan:
        plan[rng.randrange(kills)] = "broker"
    return plan


def _progress(pipe: Pipeline) -> int:
    """Samples this run has trained or committed so far (0 if the broker does not answer)."""
    s = (pipe.status() or {}).get("samples") or {}
    return (s.get("trained") or 0) + (s.get("committed") or 0)


class Operator:
    """Runs generations of the pipeline until one completes; kills per the plan."""

    def __init__(self, pipe: Pipeline, rng: random.Random, plan: list[str], deadline: float):
        self.pipe, self.rng, self.plan, self.deadline = pipe, rng, list(plan), deadline
        self.killed: Counter = Counter()
        self.generations: list[dict] = []  # per generation: run, seconds, how it ended
        # Killed consumers to start again once the broker has declared them lost; the
        # operator does not stand still meanwhile (the next kill may come first).
        self.rejoin: dict[str, str] = {}  # victim -> new instance name

    def run(self) -> None:
        resume, gen = None, 0
        while True:
            gen += 1
            t0 = time.monotonic()
            run = self.pipe.start_all(resume, gen)
            if run is None:  # the chain had committed everything before the last kill
                self.generations.append({"gen": gen, "run": None, "ended": "nothing left to train"})
                return
            ended = self._generation(gen)
            self.generations.append({"gen": gen, "run": run, "s": round(time.monotonic() - t0, 1), "ended": ended})
            if ended == "completed":
                return
            resume = run

    def _generation(self, gen: int) -> str:
        """Watch one generation; returns 'completed' or what was killed."""
        pipe, mark, kill_at = self.pipe, 0, None
        self.rejoin.clear()  # a new generation starts every role afresh
        while True:
            assert time.monotonic() < self.deadline, f"chaos run over its time bound; generations {self.generations}"
            self._restart_lost_consumers()
            codes = pipe.exited()
            if "broker" in codes:  # the broker ended by itself: the run completed (or failed)
                assert codes["broker"] == 0, pipe.tail("broker")
                # A producer the operator started just before the end may never have met the
                # broker (it ends once every peer it knew has left): not a failure.
                late = pipe.drop_late_joiners()
                assert pipe.wait_exit(list(pipe.procs), 60), f"peers still running after the broker ended: {codes}"
                bad = {n: c for n, c in pipe.exited().items() if c != 0}
                assert not bad, {n: pipe.tail(n) for n in bad}
                if late:
                    print(f"gen {gen}: {late} started too late to join; stopped")
                assert pipe.run_json(pipe.chain[-1])["outcome"] == "completed"
                return "completed"
            bad = {n: c for n, c in codes.items() if c != 0}
            assert not bad, f"exited without a kill: {bad}: {[pipe.tail(n) for n in bad]}"
            if self.plan and kill_at is None and _progress(pipe) > mark:
                kill_at = time.monotonic() + self.rng.uniform(0.0, 2.0)  # a random moment of training
            if kill_at is not None and time.monotonic() >= kill_at:
                role = self.plan[0]
                victims = pipe.live(role)
                if not victims and role == "producer":
                    # The tiny target outruns the drafters: the producers may have made the
                    # whole run already and left. A consumer takes the planned kill instead.
                    role, victims = "consumer", pipe.live("consumer")
                if role == "consumer" and len(victims) < 2:
                    # Elastic training needs a survivor: wait until the last killed consumer
                    # is back before killing another (with none left the job is lost).
                    victims = []
                if not victims:  # e.g. a restarted consumer not in yet: try again a little later
                    kill_at = time.monotonic() + 0.5
                    continue
                victim = self.rng.choice(victims)
                before = _progress_text(pipe)
                pipe.kill(victim)
                self.plan.pop(0)
                self.killed[role] += 1
                print(f"gen {gen}: SIGKILL {victim} ({before})")
                kill_at, mark = None, _progress(pipe)
                if role == "producer":  # the operator starts it again; it joins the live run
                    pipe.start_producer(f"{victim.split('-')[0]}-g{gen}r{self.killed[role]}")
                    continue
                if role == "consumer":  # the other goes on; this one rejoins once declared lost
                    self.rejoin[victim] = f"{victim.split('-')[0]}-g{gen}r{self.killed[role]}"
                    continue
                # The broker: the others find it silent and exit non-zero by themselves; the
                # operator stops what is left and resumes the run.
                pipe.wait_exit([n for n in pipe.procs if n[0] == "c"], 30)
                codes = pipe.stop_rest()
                return f"killed {victim}; exits {codes}"
            time.sleep(0.1)


    def _restart_lost_consumers(self) -> None:
        """Start again each killed consumer the broker no longer holds live (declared lost
        after --timeout-s): a restarted consumer gets its rank only then."""
        if not self.rejoin:
            return
        st = self.pipe.status()
        if st is None:  # the broker is gone (run over, or killed): nothing to rejoin
            return
        live = {p["instance"] for p in st.get("peers", [])}
        for victim in [v for v in self.rejoin if v not in live]:
            self.pipe.start_consumer(self.rejoin.pop(victim))


def _progress_text(pipe: Pipeline) -> str:
    s = (pipe.status() or {}).get("samples") or {}
    return f"trained={s.get('trained')} committed={s.get('committed')}" if s else "broker silent"


@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_S + 120)
def test_sigkill_chaos_trains_every_sample_exactly_once(tmp_path):
    seed = int(os.environ.get("DFLASH_CHAOS_SEED") or random.SystemRandom().randrange(1 << 30))
    print(f"\nchaos seed {seed} (DFLASH_CHAOS_SEED={seed} replays the plan), kills {KILLS}, "
          f"{N_ROWS} samples x {EPOCHS} epochs")
    rng = random.Random(seed)
    plan = _plan(rng, KILLS)
    pipe = Pipeline(tmp_path, n_rows=N_ROWS, epochs=EPOCHS, seed=seed % 1000)
    t0 = time.monotonic()
    op = Operator(pipe, rng, plan, t0 + DEADLINE_S)
    try:
        op.run()
    finally:
        pipe.close()
    wall = time.monotonic() - t0
    a = audit(pipe.runs, pipe.chain, EPOCHS, N_ROWS)
    print(f"kills survived: {dict(op.killed)} (planned {plan})")
    print(f"samples lost: {len(a.lost)}, samples duplicated: {len(a.duplicated)}, "
          f"committed {sum(a.ledger.values())}/{len(a.expected)}, in the final weights {sum(a.record.values())}")
    print(f"runs in the chain: {len(pipe.chain)}; generations: {op.generations}; wall {wall:.0f} s")

    assert sum(op.killed.values()) == KILLS and op.killed["broker"] >= 1, (op.killed, op.generations)
    assert a.inherited_ok, "a resumed run did not inherit exactly its parents' commits"
    assert not a.lost, sorted(a.lost)[:20]
    assert not a.duplicated, sorted(a.duplicated)[:20]
    assert not a.unexpected, sorted(a.unexpected)[:20]
    assert a.record_complete
    _loads(a.final_checkpoint)


def _loads(path) -> None:
    """The final checkpoint loads into a drafter with the consumer's own loader."""
    import json

    import torch

    from dflash.consumers.checkpoint import load_checkpoint
    from dflash.consumers.model import DFlashDraft, DrafterConfig
    from dflash.consumers.target_heads import load_target_heads
    from dflash.tools.tiny import tiny_target

    heads = load_target_heads(tiny_target(), dtype=torch.float32)
    state = json.loads((path / "state.json").read_text())
    model = DFlashDraft(DrafterConfig.from_target(heads.spec, 1, len(state["signal"]["target_layers"])))
    saved, rng = load_checkpoint(path, model, torch.optim.AdamW(model.parameters()))
    assert saved["step"] == state["step"] and len(rng) == 2
