"""Run a command with its stderr on a pseudo-terminal, as a person at a terminal sees it:
progress bars draw there (runtime/progress.py), and only there."""

from __future__ import annotations

import os
import pty
import subprocess


def on_a_terminal(argv: list[str], env: dict, timeout_s: float = 300) -> tuple[int, str, str]:
    """(exit code, what reached the terminal on stderr, stdout) of `argv` with stderr a pty."""
    main, sub = pty.openpty()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=sub, env=env)
    os.close(sub)
    seen = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        seen += chunk
    out = p.stdout.read().decode()
    p.wait(timeout_s)
    os.close(main)
    return p.returncode, seen.decode(errors="replace"), out
