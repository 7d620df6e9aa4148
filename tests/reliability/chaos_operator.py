"""An operator's hands on a chaos Pipeline: run generations of the pipeline (a fresh run,
then `--resume` after each broker death) until one completes, SIGKILL processes when
`next_kill` says so, and restart each role the way docs/RELIABILITY.md 7 says:

- a producer: started again, it joins the live run (the broker gave its leases back);
- a consumer: the other one goes on (elastic); once the broker has declared the dead one
  lost, it is started again and rejoins the live run;
- the broker: every peer exits non-zero; the operator stops what is left and resumes.

`Operator` is the chaos test's (a fixed plan of victims, a kill soon after progress, any
exit without a kill fails the test). soak.py subclasses it: kills on a clock, a stop on
purpose at its deadline, and exits without a kill handled as an operator would (counted,
then restarted) rather than ending the soak.
"""

from __future__ import annotations

import random
import time
from collections import Counter

from tests.reliability.chaos_pipeline import Pipeline

ROLES = ("broker", "producer", "consumer")


def progress(pipe: Pipeline) -> int:
    """Samples this run has trained or committed so far (0 if the broker does not answer)."""
    s = (pipe.status() or {}).get("samples") or {}
    return (s.get("trained") or 0) + (s.get("committed") or 0)


def progress_text(pipe: Pipeline) -> str:
    s = (pipe.status() or {}).get("samples") or {}
    return f"trained={s.get('trained')} committed={s.get('committed')}" if s else "broker silent"


class Operator:
    """Runs generations of the pipeline until one completes; kills per the plan."""

    def __init__(self, pipe: Pipeline, rng: random.Random, plan: list[str], deadline: float):
        self.pipe, self.rng, self.plan, self.deadline = pipe, rng, list(plan), deadline
        self.killed: Counter = Counter()
        self.restarted: Counter = Counter()  # role -> processes started again by the operator
        self.generations: list[dict] = []  # per generation: run, seconds, how it ended
        # Killed consumers to start again once the broker has declared them lost; the
        # operator does not stand still meanwhile (the next kill may come first).
        self.rejoin: dict[str, str] = {}  # victim -> new instance name

    # ------------------------------------------------------------ hooks (soak.py overrides)

    def next_kill(self) -> str | None:
        """The role of the next kill, or None when no kill is left to do."""
        return self.plan[0] if self.plan else None

    def kill_time(self, now: float) -> float:
        """When to kill, once the run made progress since the last kill (`now`)."""
        return now + self.rng.uniform(0.0, 2.0)  # a random moment of training

    def killed_one(self, role: str) -> None:
        self.plan.pop(0)

    def stop_now(self) -> bool:
        """True when the operator stops the run on purpose (SIGTERM, drain, resume later)."""
        return False

    def unexpected_exits(self, gen: int, bad: dict[str, int]) -> str | None:
        """Processes that exited non-zero without a kill. The chaos test fails on them; a
        subclass may handle them and return how the generation ended (None: go on)."""
        raise AssertionError(f"exited without a kill: {bad}: {[self.pipe.tail(n) for n in bad]}")

    def broker_ended(self, gen: int, code: int) -> str:
        """The broker ended by itself: the run completed (or failed)."""
        pipe = self.pipe
        assert code == 0, pipe.tail("broker")
        # A producer the operator started just before the end may never have met the
        # broker (it ends once every peer it knew has left): not a failure.
        late = pipe.drop_late_joiners()
        assert pipe.wait_exit(list(pipe.procs), 60), f"peers still running after the broker ended: {pipe.exited()}"
        bad = {n: c for n, c in pipe.exited().items() if c != 0}
        assert not bad, {n: pipe.tail(n) for n in bad}
        if late:
            print(f"gen {gen}: {late} started too late to join; stopped")
        assert pipe.run_json(pipe.chain[-1])["outcome"] == "completed"
        return "completed"

    # ------------------------------------------------------------ the loop

    def run(self, resume: str | None = None, gen: int = 0) -> str:
        """Generations until one completes (or the operator stops on purpose); how the last ended."""
        while True:
            gen += 1
            t0 = time.monotonic()
            run = self.pipe.start_all(resume, gen)
            if gen > 1:
                self.restarted["generation"] += 1
            if run is None:  # the chain had committed everything before the last kill
                self.generations.append({"gen": gen, "run": None, "ended": "nothing left to train"})
                return "nothing left to train"
            ended = self._generation(gen)
            self.generations.append({"gen": gen, "run": run, "s": round(time.monotonic() - t0, 1), "ended": ended})
            if ended in ("completed", "stopped") or ended.startswith("final:"):
                return ended
            resume = run

    def _generation(self, gen: int) -> str:
        """Watch one generation; returns 'completed', 'stopped' or what was killed."""
        pipe, mark, kill_at = self.pipe, 0, None
        self.rejoin.clear()  # a new generation starts every role afresh
        while True:
            assert time.monotonic() < self.deadline, f"chaos run over its time bound; generations {self.generations}"
            self._restart_lost_consumers()
            codes = pipe.exited()
            if "broker" in codes:
                return self.broker_ended(gen, codes["broker"])
            bad = {n: c for n, c in codes.items() if c != 0}
            if bad:
                ended = self.unexpected_exits(gen, bad)
                if ended is not None:
                    return ended
                continue
            if self.stop_now():
                before = progress_text(pipe)
                codes = pipe.stop_rest()
                print(f"gen {gen}: stopped on purpose ({before}); exits {codes}", flush=True)
                return "stopped"
            role = self.next_kill()
            if role is not None and kill_at is None and progress(pipe) > mark:
                kill_at = self.kill_time(time.monotonic())
            if role is not None and kill_at is not None and time.monotonic() >= kill_at:
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
                before = progress_text(pipe)
                pipe.kill(victim)
                self.killed_one(role)
                self.killed[role] += 1
                print(f"gen {gen}: SIGKILL {victim} ({before})", flush=True)
                kill_at, mark = None, progress(pipe)
                if role == "producer":  # the operator starts it again; it joins the live run
                    pipe.start_producer(f"{victim.split('-')[0]}-g{gen}r{self.killed[role]}")
                    self.restarted["producer"] += 1
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
            self.restarted["consumer"] += 1
