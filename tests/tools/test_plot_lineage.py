"""dflash-plot of a resumed run covers its lineage (issue 20: it showed the resumed run's
own steps only), says when an earlier run is gone, and the empty per-position panel says
why it is empty. Real runs: dflash-consume on its synthetic stream, then --resume."""

from __future__ import annotations

import os
import shutil

import pytest
from click.testing import CliRunner

from dflash.tools.plot import lineage_series
from dflash.tools.plot import main as plot
from dflash.tools.tiny import tiny_target

pytestmark = pytest.mark.unit

CLEAN = {k: None for k in os.environ if k.startswith("DFLASH_")}


def _consume(runs, *extra):
    from dflash.consumers.process.consume_command import main as consume

    r = CliRunner().invoke(consume, ["--target", str(tiny_target()), "--runs-dir", str(runs), "--draft-layers", "1",
                                     "--block-size", "4", "--anchors", "4", "--synthetic-seq-len", "32",
                                     "--synthetic-seqs", "2", "--log-position-every", "0", *extra], env=CLEAN)
    assert r.exit_code == 0, r.output
    return (runs / "latest").resolve()


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    runs = tmp_path_factory.mktemp("lineage") / "runs"
    first = _consume(runs, "--synthetic-batches", "6", "--save-every", "3")
    second = _consume(runs, "--synthetic-batches", "3", "--save-every", "0",
                      "--resume", str(first / "checkpoints" / "step-3"))
    return runs, first, second


def test_a_resumed_runs_plot_has_the_steps_of_its_lineage(resumed, tmp_path):
    runs, first, second = resumed
    assert second != first
    series, _pos, lineage, missing = lineage_series(second)
    assert [r.name for r in lineage] == [first.name, second.name] and missing is None
    # steps 1-3 from the first run (4-6 there were trained again in the second), then the second's
    assert series["step"] == list(range(1, series["step"][-1] + 1)) and series["step"][-1] >= 6
    r = CliRunner().invoke(plot, ["--run", second.name, "--runs-dir", str(runs), "--out", str(tmp_path / "p.png")],
                           env=CLEAN)
    assert r.exit_code == 0 and "from 2 runs of its lineage" in r.output, r.output


def test_a_missing_earlier_run_is_said(resumed, tmp_path):
    runs, first, second = resumed
    copy = tmp_path / "runs"
    copy.mkdir()
    shutil.copytree(second, copy / second.name, symlinks=True)
    r = CliRunner().invoke(plot, ["--run", second.name, "--runs-dir", str(copy), "--out", str(tmp_path / "p.png")],
                           env=CLEAN)
    assert r.exit_code == 0 and f"earlier run {first.name} not found: its steps are not shown" in r.output, r.output


def test_the_empty_position_panel_says_why(resumed, tmp_path):
    """The text is drawn into the figure: read it back from the matplotlib figure the
    renderer builds (the PNG's pixels do not say it in words)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dflash.tools.plot import render

    runs, _first, second = resumed
    series, pos, _l, _m = lineage_series(second)
    assert pos is None  # --log-position-every 0
    shown = []
    real_close = plt.close
    plt.close = lambda fig: shown.extend(t.get_text() for ax in fig.axes for t in ax.texts) or real_close(fig)
    try:
        render(series, pos, tmp_path / "p.png", "t")
    finally:
        plt.close = real_close
    assert any("no train.position_acc line yet" in t and "--log-position-every" in t for t in shown), shown
