"""The soak script (soak.py) as a test: its short form runs it as a user would (its command
line, its JSON summary), with kills on a short clock, a stop at the deadline and --finish,
so the run ends and the audit is the complete one (every (epoch, sample) once in the final
weights). It takes a few minutes on two cores, on top of test_chaos.py's short form, which
CI runs already: so it runs only with DFLASH_SOAK=1 (the short form) or DFLASH_LONG=1 (5
minutes of chaos on more data); the 30-minute form is run by hand (soak.py's docstring).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.harness.spawn import child_env, module_argv

pytestmark = pytest.mark.integration

LONG = os.environ.get("DFLASH_LONG") == "1"
RUN = LONG or os.environ.get("DFLASH_SOAK") == "1"
ARGS = (["--minutes", "5", "--kill-every", "20-40", "--rows", "400", "--epochs", "8"] if LONG else
        ["--minutes", "1.25", "--kill-every", "8-15", "--rows", "120", "--epochs", "3"])
TIMEOUT_S = 1500 if LONG else 420


@pytest.mark.slow
@pytest.mark.skipif(not RUN, reason="the soak's short form runs with DFLASH_SOAK=1 (DFLASH_LONG=1: 5 minutes)")
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_soak_short_form_loses_nothing_and_the_checkpoint_loads(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    p = subprocess.run(module_argv("tests.reliability.soak", *ARGS, "--finish", "--finish-minutes", "5", "--out",
                                   str(tmp_path / "soak")), capture_output=True, text=True, timeout=TIMEOUT_S,
                       env=child_env(env))
    print(p.stdout[-3000:], p.stderr[-3000:])
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == (0 if summary["ok"] else 1)
    assert summary["ok"], summary
    assert summary["ended"] in ("completed", "nothing left to train"), summary
    assert summary["lost"] == 0 and summary["duplicated"] == 0 and summary["checkpoint_load_ok"]
    # Complete: every (epoch, sample) trained once, and the operator did restart things.
    assert summary["samples_trained"] == summary["committed"] == summary["expected"] == 120 * 3 or LONG, summary
    assert sum(summary["kills"].values()) >= 1 and summary["exits_without_kill"] == 0, summary
    assert (tmp_path / "soak" / "soak-summary.json").is_file()
