"""dflash-status of a resumed run counts what its parent did (issue 20: it said
"committed 0 of 800 (2.1%)" with 84 left, ETA as if nothing was done). Real brokers and
fake peers: a run commits part of its samples and stops, the resumed run's status map
and dflash-status's text count the parent's samples as done."""

from __future__ import annotations

import subprocess
import sys

from tests.harness.spawn import killed_part_way

from dflash.tools.status_view import header
import pytest

pytestmark = pytest.mark.integration

N, EPOCHS = 40, 1


def test_a_resumed_runs_progress_counts_the_inherited_samples(brokers):
    b1, done = killed_part_way(brokers, N, "--epochs", str(EPOCHS))
    parent = len(done)
    assert 0 < parent < N

    b2 = brokers("--resume", b1.run_id)
    st = b2.ask()
    p = st["progress"]
    assert p["inherited"] == parent and p["done"] == parent, p
    # trained and committed over the chain (issue 29: a finished resumed run left its parent's out)
    assert p["trained"] == p["committed"] == parent and p["epoch"] == 0, p
    assert p["fraction"] == round(parent / N, 4)
    text = "\n".join(header(st))
    assert f"samples trained {parent} committed {parent} (incl. {parent} from the resumed run) of {N}" in text, text
    r = subprocess.run([sys.executable, "-m", "dflash.tools.status_command", "--broker", b2.control], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0 and f"(incl. {parent} from the resumed run)" in r.stdout, r.stdout + r.stderr
    assert b2.stop() == 0
