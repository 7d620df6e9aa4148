"""soak.py's verdict in-process: `ok` wants the audit clean and training late in the chaos
phase (docs/RELIABILITY.md 11); no processes."""

from __future__ import annotations

import pytest

from tests.reliability.soak import exit_reasons, late_progress, late_window_s, verdict

pytestmark = pytest.mark.unit

CLEAN = dict(error=None, ended="stopped", lost=0, duplicated=0, unexpected=0, inherited_ok=True,
             record_complete=True, load_ok=True)


def test_the_late_window_is_two_minutes_or_a_tenth_of_the_soak():
    assert late_window_s(1.25) == 120 and late_window_s(30) == 180 and late_window_s(120) == 720


def test_a_soak_that_stopped_training_five_minutes_before_its_deadline_is_not_ok():
    # A soak whose consumers were all refused for its last minutes (the code changed under
    # it): commits stop well before the deadline, the stop commits nothing.
    commits = [(t, 4) for t in range(34, 1495, 10)] + [(1500.0, 0)]
    late = late_progress(commits, chaos_end=1800, end=1927, window_s=late_window_s(30))
    assert late == {"late_window_s": 180, "late_committed": 0, "last_commit_age_s": 433}
    assert verdict(**CLEAN, late_committed=late["late_committed"]) == ["no samples committed late in the chaos phase"]


def test_a_commit_in_the_window_or_during_the_stop_is_enough():
    w = late_window_s(30)
    for ts in (1800 - w, 1799, 1850):
        late = late_progress([(100, 8), (ts, 4)], chaos_end=1800, end=1860, window_s=w)
        assert late["late_committed"] == 4 and verdict(**CLEAN, late_committed=4) == []
    # Commits after the chaos run (a --finish) do not count.
    assert late_progress([(100, 8), (1900, 4)], chaos_end=1800, end=1860, window_s=w)["late_committed"] == 0


def test_a_run_that_completed_before_its_deadline_needs_its_last_commits_only():
    late = late_progress([(100, 8), (600, 8)], chaos_end=1800, end=650, window_s=180)
    assert late["late_committed"] == 8 and late["last_commit_age_s"] == 50
    assert late_progress([], chaos_end=1800, end=650, window_s=180)["last_commit_age_s"] is None


def test_every_audit_failure_is_named():
    why = verdict(error="KeyboardInterrupt: ", ended="final: broker exited 3 (nothing_to_train)", lost=2,
                  duplicated=1, unexpected=3, inherited_ok=False, record_complete=False, load_ok=False, late_committed=5)
    assert len(why) == 8 and why[0].startswith("error:") and "lost 2" in why and "duplicated 1" in why
    assert verdict(**{**CLEAN, "ended": None}, late_committed=5) == ["ended: None"]


def test_exits_without_a_kill_are_grouped_by_role_code_and_reason():
    refused = "error: checkpoint ... was trained with another training signal (anchor_every: 1 -> 3)"
    exits = [{"gen": g, "name": f"c{g % 2}-g{g}", "code": 2, "last": refused} for g in range(6)]
    exits += [{"gen": 7, "name": "p0-g7", "code": 1, "last": "broker silent"}, {"gen": 8, "name": "broker", "code": -6, "last": ""}]
    assert exit_reasons(exits) == [{"role": "consumer", "code": 2, "last": refused, "n": 6},
                                   {"role": "producer", "code": 1, "last": "broker silent", "n": 1},
                                   {"role": "broker", "code": -6, "last": "", "n": 1}]
