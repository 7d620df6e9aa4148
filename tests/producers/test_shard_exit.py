"""A sharded producer rank leaves through `shard.run_then_exit` (os._exit, so that no Gloo
worker thread is ended mid-release at interpreter shutdown): it must still exit with the
code its life ended with, print what the interpreter would have printed, and lose no
buffered output."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

BODIES = {
    "returns": ("print('done', end='')", 0, "done", ""),
    "fails with a reason": ("from dflash.runtime.command_line import fail; fail('bad --data', code=2)", 2, "",
                            "error: bad --data"),
    "raises": ("raise RuntimeError('boom in rank')", 1, "", "RuntimeError: boom in rank"),
    "exits with a message": ("import sys; sys.exit('gone: why')", 1, "", "gone: why"),
    "is interrupted": ("raise KeyboardInterrupt", 130, "", ""),
}


@pytest.mark.parametrize("case", list(BODIES))
def test_run_then_exit_keeps_the_exit_code_and_the_output(case):
    body, code, out, err = BODIES[case]
    script = ("import sys\nfrom dflash.producers import shard\n"
              f"def life():\n    {body}\n"
              "sys.stdout.write('buffered ')\n"  # unflushed before os._exit: must not be lost
              "shard.run_then_exit(life)\nprint('never reached')\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == code, res.stderr
    assert res.stdout == "buffered " + out
    assert err in res.stderr and "never reached" not in res.stdout
