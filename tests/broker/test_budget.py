"""--time-budget's plan (broker/budget.py) against BrokerCore in-process: no sockets, an
injected clock. A fake pace of training (a lease made, relayed, acked and committed per turn)
drives the core as peers would; the tests check the plan it logs and tells peers, that
nothing is leased past it, and how the run ends: at the plan before the deadline, at the
dataset's end first, or not at all while training is stalled (with no finite ETA)."""

from __future__ import annotations

import pytest

from structlog.testing import capture_logs

from dflash.broker.budget import Budget, parse_duration, reserve_for
from dflash.broker.leases import MAX_OPEN_LEASES
from dflash.broker.phase import Phase
from dflash.tools.status_view import header
from tests.harness.core_rig import T0, Rig, sent

pytestmark = pytest.mark.unit


@pytest.fixture
def log_records():
    with capture_logs() as records:
        yield records


# ---------------------------------------------------------------- the arithmetic alone


@pytest.mark.parametrize("text,seconds", [("600", 600), ("600s", 600), ("10m", 600), ("1h30m", 5400),
                                          ("1h2m3s", 3723), ("1.5h", 5400), (" 45S ", 45), (90, 90)])
def test_durations_in_every_accepted_form(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "10x", "1h3", "m", "-5", "0", "0s", "10 m", "1m1h"])
def test_a_bad_duration_says_which_forms_are_accepted(text):
    with pytest.raises(ValueError, match=r"duration"):
        parse_duration(text)


def test_the_plan_is_what_the_rate_trains_before_the_reserve_within_leased_and_total():
    b = Budget(1000.0, started=0.0)
    assert (b.every_s, b.reserve_s) == (30.0, reserve_for(1000.0)) == (30.0, 50.0)
    assert b.planned is None and b.lease_limit(done=10, lead=8) == 18  # warm-up: a lead ahead of done
    b.observe(4.0, 0)  # nothing trained yet: still the warm-up
    assert b.first_trained_at is None and not b.due(100.0)
    b.observe(5.0, 8)
    assert not b.due(34.9) and b.due(35.0)
    fig = b.plan(100.0, done=400, leased=450, total=10**6, rate=4.0)
    assert fig.planned_samples == 400 + 4 * (1000 - 50 - 100) and fig.reason == "rate"
    assert b.lease_limit(done=400, lead=8) == fig.planned_samples and b.next_at == 130.0
    # the pace doubles: the rest of the time at the new pace
    assert b.plan(400.0, done=2000, leased=2100, total=10**6, rate=8.0).planned_samples == 2000 + 8 * 550
    # slower than what is leased already: the plan never drops below it (no lease is taken back)
    assert b.plan(900.0, done=3000, leased=3500, total=10**6, rate=1.0).planned_samples == 3500
    # past the deadline's reserve: nothing more than is leased
    fig = b.plan(960.0, done=3400, leased=3500, total=10**6, rate=8.0)
    assert (fig.planned_samples, fig.reason) == (3500, "deadline")
    # the dataset ends first
    fig = b.plan(100.0, done=400, leased=450, total=1000, rate=4.0)
    assert (fig.planned_samples, fig.reason) == (1000, "dataset") and b.final(1000)


def test_a_warm_up_that_reaches_the_reserve_plans_what_is_leased():
    b = Budget(100.0, started=0.0)
    assert not b.due(94.9) and b.due(95.0)  # nothing trained yet, and the reserve begins
    fig = b.plan(95.0, done=0, leased=16, total=10**6, rate=b.rate(95.0))
    assert (fig.planned_samples, fig.reason) == (16, "deadline") and b.lease_limit(done=0, lead=8) == 16


def test_a_stall_plans_nothing_more_and_has_no_eta():
    b = Budget(1000.0, started=0.0)
    b.observe(1.0, 4)
    fig = b.plan(200.0, done=300, leased=320, total=10**6, rate=0.0)
    assert (fig.planned_samples, fig.reason) == (320, "stalled")
    assert b.eta_s(200.0, done=300, total=10**6, rate=0.0) is None
    assert b.eta_s(200.0, done=300, total=10**6, rate=4.0) == 5.0


# ---------------------------------------------------------------- the core, driven at a pace


class Pace:
    """A producer and a consumer at `per_turn` samples per `dt` seconds: each turn the
    producer makes what it may lease, the consumer trains and commits what it was sent."""

    def __init__(self, rig: Rig):
        self.rig, self.step, self.ended_at = rig, 0, None
        rig.hello(b"prod", "producer")
        rig.consumer(credit=64)
        rig.tick(rig.advance(0.01))

    def turn(self, dt: float, leases: int = 1, train: bool = True) -> None:
        rig = self.rig
        rig.advance(dt)
        for _ in range(leases):
            grant = sent(rig.control(b"prod", "lease", want=4), "grant")[0].fields
            if grant["lease"]:
                rig.batch(rig.peer(b"prod").id, grant["lease"], grant["epoch"], grant["samples"])
                rig.control(b"prod", "done", lease=grant["lease"], skipped=[])
        rig.dispatch()
        if train and (held := rig.in_flight(b"cons")):
            self.step += 1
            rig.control(b"cons", "ack", batch_ids=held, step=self.step)
            rig.control(b"cons", "commit", step=self.step, checkpoint=f"ckpt/{self.step}")
            rig.control(b"cons", "credit", credit=len(held))
        rig.tick()
        if rig.core.life.end is not None and self.ended_at is None:  # told to stop: both leave
            self.ended_at = rig.now
            for who in (b"prod", b"cons"):
                rig.control(who, "bye", reason="stop")
            rig.tick(rig.advance(0.01))


def counts(rig: Rig) -> dict:
    return dict(rig.core.ledger.counts)


def leased(rig: Rig) -> int:
    """Samples this run ever leased: in any state from leased on."""
    c = rig.core.ledger.counts
    return sum(c[k] for k in ("leased", "produced", "delivered", "trained", "committed", "skipped"))


def plans(records) -> list[dict]:
    return [r for r in records if r["event"] == "broker.plan"]


def test_the_plan_follows_the_rate_and_the_run_ends_at_it_before_the_deadline(tmp_path, log_records):
    with Rig(tmp_path, epochs=1000, time_budget=100.0) as rig:
        budget, pool = rig.core.budget, rig.core.work.pool
        assert (budget.every_s, budget.reserve_s) == (10.0, 5.0)
        pace = Pace(rig)
        # warm-up: a lead (the leases a producer may hold open) ahead of what is done, and the dataset's plan told
        pace.turn(1.0, leases=6, train=False)
        assert leased(rig) == 4 * MAX_OPEN_LEASES == pool.limit and budget.planned is None
        assert "plan: warm-up" in next(x for x in header(rig.status()) if x.startswith("budget"))
        beat = [a for a in rig.tick(rig.advance(1.0)) if getattr(a, "type", None) == "heartbeat"]
        assert beat and beat[0].fields["planned_samples"] == 8 * 1000
        while budget.planned is None:  # 4 samples/s
            pace.turn(1.0)
        first = plans(log_records)[-1]
        done = counts(rig)["committed"]
        assert first["reason"] == "rate" and first["done"] == done and 3.0 <= first["rate"] <= 4.5
        room = T0 + 100.0 - 5.0 - rig.now
        assert first["planned_samples"] == done + int(first["rate"] * room) or \
            abs(first["planned_samples"] - (done + first["rate"] * room)) <= 1
        assert first["elapsed_s"] == pytest.approx(rig.now - T0, abs=1e-3) and first["budget_s"] == 100.0
        # the pace doubles: the next plan is larger than the first's extrapolation
        while len(plans(log_records)) == 1:
            pace.turn(1.0, leases=2)
        second = plans(log_records)[-1]
        assert second["rate"] > first["rate"] and second["planned_samples"] > first["planned_samples"]
        # nothing is leased past the plan, and the run ends once the plan is trained
        while not rig.core.done and rig.now < T0 + 200:
            pace.turn(1.0, leases=2)
            assert leased(rig) <= budget.planned
        last = plans(log_records)[-1]
        assert rig.core.done and rig.core.outcome == "completed"
        assert counts(rig)["committed"] == last["planned_samples"] == budget.planned
        assert T0 + 100 - 5 - 10 <= pace.ended_at <= T0 + 100  # within a re-plan period before the reserve
        ends = [r for r in log_records if r["event"] == "broker.end_of_stream"]
        assert len(ends) == 1 and rig.core.life.end.reason == "end_of_stream"


def test_a_plan_trained_early_is_planned_again_not_ended(tmp_path, log_records):
    with Rig(tmp_path, epochs=1000, time_budget=100.0) as rig:
        pace = Pace(rig)
        while rig.core.budget.planned is None:
            pace.turn(4.0)  # 1 sample/s
        first = rig.core.budget.planned
        for _ in range(12):
            pace.turn(0.2, leases=3)  # training speeds up: the plan is trained long before the next re-plan
        assert not rig.core.done and rig.core.life.phase is Phase.RUNNING and rig.core.life.end is None
        drained = [p for p in plans(log_records) if p["reason"] == "drained"]
        assert drained and drained[0]["done"] == first and drained[0]["planned_samples"] > first
        assert counts(rig)["committed"] > first


def test_the_dataset_ends_before_the_budget_as_without_one(tmp_path, log_records):
    with Rig(tmp_path, epochs=3, time_budget=3600.0) as rig:
        pace = Pace(rig)
        while not rig.core.done and rig.now < T0 + 600:
            pace.turn(1.0)
        assert rig.core.done and rig.core.outcome == "completed" and counts(rig)["committed"] == 3 * 8
        assert pace.ended_at < T0 + 60  # at the pace's end of the dataset, long before the deadline


def test_a_stall_plans_nothing_past_what_is_leased_and_the_eta_is_unknown(tmp_path, log_records):
    with Rig(tmp_path, epochs=1000, time_budget=1000.0, timeout_s=10_000.0, ack_timeout_s=10_000.0) as rig:
        pace = Pace(rig)
        while rig.core.budget.planned is None:
            pace.turn(1.0)
        assert rig.status()["progress"]["eta_s"] is not None
        budget_line = next(x for x in header(rig.status()) if x.startswith("budget"))
        assert "plan " in budget_line and "trained in " in budget_line and "left (reserve 50.0s)" in budget_line
        for _ in range(100):  # the consumer trains nothing for 100 s (the rate's window is 60)
            pace.turn(1.0, train=False)
        stalled = plans(log_records)[-1]
        held = leased(rig)
        assert stalled["reason"] == "stalled" and stalled["rate"] == 0 and stalled["planned_samples"] == held
        progress = rig.status()["progress"]
        assert progress["samples_per_s"] == 0 and progress["eta_s"] is None and progress["eta_at"] is None
        assert progress["budget"]["reason"] == "stalled" and progress["budget"]["planned_samples"] == held
        budget_line = next(x for x in header(rig.status()) if x.startswith("budget"))  # dflash-status
        assert "(stalled," in budget_line and "trained by: never at the current pace" in budget_line
        assert "ETA -" in header(rig.status())[1]
        assert not rig.core.done  # what is leased waits to be trained; nothing ends the run meanwhile
        # training resumes: the next plans grow again
        for _ in range(40):
            pace.turn(1.0)
        assert plans(log_records)[-1]["reason"] == "rate" and rig.core.budget.planned > held


def test_the_pace_is_over_a_minute_so_a_burst_after_a_stall_is_not_a_fast_pace():
    b = Budget(1000.0, started=0.0)
    for t in range(1, 61):
        b.observe(float(t), 4 * t)  # 4 samples/s
    assert b.rate(60.0) == pytest.approx(4.0, rel=0.05)
    for t in range(61, 161):
        b.observe(float(t), 240)  # stalled
    assert b.rate(160.0) == 0.0
    b.observe(161.0, 240 + 256)  # everything held is acked at once
    assert b.rate(161.0) <= 256 / 60


# ---------------------------------------------------------------- the option


def test_the_option_takes_each_form_and_a_bad_one_is_a_click_error_naming_it(monkeypatch):
    from click.testing import CliRunner

    from dflash.broker.broker_command import main

    monkeypatch.delenv("DFLASH_BROKER_TIME_BUDGET", raising=False)
    for text, seconds in (("600", 600.0), ("10m", 600.0), ("1h30m", 5400.0)):
        assert main.make_context("dflash-broker", ["--time-budget", text]).params["time_budget"] == seconds
    assert main.make_context("dflash-broker", []).params["time_budget"] is None
    for bad in ("10x", "0", "-1m"):
        r = CliRunner().invoke(main, ["--time-budget", bad])
        assert r.exit_code == 2 and "Invalid value for '--time-budget'" in r.output, r.output
        assert "600s, 10m, 1h30m" in r.output or "positive" in r.output
    monkeypatch.setenv("DFLASH_BROKER_TIME_BUDGET", "soon")
    r = CliRunner().invoke(main, [])
    assert r.exit_code == 2 and "'--time-budget'" in r.output and "DFLASH_BROKER_TIME_BUDGET" in r.output


# ---------------------------------------------------------------- the schedule's progress


def test_the_schedule_follows_the_clock_not_an_early_plan_that_training_outruns():
    # The H100 run of 2026-12-06: the first plan, made while the first steps still compiled,
    # was trained long before the deadline. The schedule's progress follows the training
    # window's time instead, so the lr is not at min-lr for most of the run.
    b = Budget(400.0, started=0.0, reserve_s=20.0, every_s=30.0)
    assert b.progress(5.0) == 0.0  # nothing trained yet
    b.observe(20.0, 10)  # first sample trained at 20 s: the window is 20 .. 380 s
    b.plan(50.0, done=300, leased=400, total=10**6, rate=10.0)  # slow start: 300 + 10 x 330
    b.observe(110.0, 3600)  # the plan (3,600) is trained after 90 s of 360: far from the end
    assert b.progress(110.0) == pytest.approx(90 / 360)
    assert b.progress(200.0) == pytest.approx(180 / 360)
    assert b.progress(380.0) == 1.0 and b.progress(390.0) == 1.0


def test_the_last_plan_ends_at_progress_one_on_its_last_sample_and_progress_never_falls():
    b = Budget(400.0, started=0.0, reserve_s=20.0, every_s=30.0)
    b.observe(20.0, 10)
    b.observe(360.0, 3000)
    fig = b.plan(360.0, done=3000, leased=3000, total=10**6, rate=10.0)  # the last plan: 20 s of room
    assert fig.planned_samples == 3200
    p0 = b.progress(360.0)
    assert p0 == pytest.approx(340 / 360)
    b.observe(365.0, 3200)  # trained early, 15 s before the window's end
    assert b.progress(365.0) == 1.0
    b.plan(365.0, done=3200, leased=3200, total=10**6, rate=40.0)  # re-planned: more to train
    assert b.progress(366.0) == 1.0  # never falls (the lr never rises again)


def test_a_dataset_that_ends_before_the_deadline_ends_the_schedule_with_it():
    b = Budget(400.0, started=0.0, reserve_s=20.0, every_s=30.0)
    b.observe(20.0, 10)
    b.dataset_done, b.dataset_total = 180, 200  # 9 in 10 of epochs x samples trained after 10 s
    assert b.progress(30.0) == pytest.approx(0.9)
    b.dataset_done = 200
    assert b.progress(31.0) == 1.0
