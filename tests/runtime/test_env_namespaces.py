"""One namespace of environment variables per command (issue 20): a variable set for one
command never changes another. `DFLASH_INSTANCE=prodA`, meant for a producer, once made
`dflash-logs --instance` filter out every line; DFLASH_SEED, DFLASH_JSON, DFLASH_FORCE,
DFLASH_LIMIT and DFLASH_MAX_NEW_TOKENS were shared the same way. Only SHARED_ENV (the
broker address, the runs folder, the Curve keys) is read by several commands, on purpose."""

from __future__ import annotations

import os
from collections import defaultdict

import click
import pytest
from click.testing import CliRunner

from dflash.runtime.command_line import SHARED_ENV
from dflash.tools import clidoc

pytestmark = pytest.mark.unit


def _envvars(cmd: click.Command) -> set[str]:
    out = set()
    for p in cmd.params:
        env = getattr(p, "envvar", None)
        out |= {env} if isinstance(env, str) else set(env or ())
    return out


SCRIPTS = {s.name: s.command for s in clidoc.scripts()}


def test_every_option_variable_is_in_its_commands_namespace_or_shared_on_purpose():
    readers = defaultdict(set)
    for name, cmd in SCRIPTS.items():
        for env in _envvars(cmd):
            readers[env].add(name)
            assert env in SHARED_ENV or env.startswith(cmd.env_namespace), (name, env)
    leaks = {env: sorted(cmds) for env, cmds in readers.items() if len(cmds) > 1 and env not in SHARED_ENV}
    assert not leaks, f"variables read by more than one command: {leaks}"
    # the shared ones are shared indeed (else they belong in a namespace)
    assert all(len(readers[e]) >= 2 for e in SHARED_ENV), {e: readers[e] for e in SHARED_ENV}


def test_no_command_reads_the_auto_prefix_or_an_unnamespaced_variable():
    for name, cmd in SCRIPTS.items():
        assert (cmd.context_settings or {}).get("auto_envvar_prefix") is None, name
        if getattr(cmd, "env_namespace", None) is None:  # keygen: no variables at all
            assert not _envvars(cmd), name


def _other_commands_variables(mine: str) -> dict[str, str]:
    """Every variable of every other command (shared ones left out), set to a value that
    would change or break this command if it read any of them."""
    return {env: "prodA" for name, cmd in SCRIPTS.items() if name != mine
            for env in _envvars(cmd) if env not in SHARED_ENV}


@pytest.fixture(scope="module")
def run_with_logs(tmp_path_factory):
    """A real (local, synthetic) consumer run: its logs have train.step lines."""
    from dflash.consumers.process.consume_command import main as consume
    from dflash.tools.tiny import tiny_target

    runs = tmp_path_factory.mktemp("env") / "runs"
    r = CliRunner().invoke(consume, ["--target", str(tiny_target()), "--runs-dir", str(runs), "--draft-layers", "1",
                                     "--block-size", "4", "--anchors", "4", "--synthetic-seq-len", "32",
                                     "--synthetic-seqs", "2", "--synthetic-batches", "3", "--save-every", "0"],
                           env={k: None for k in os.environ if k.startswith("DFLASH_")})
    assert r.exit_code == 0, r.output
    return runs


@pytest.mark.parametrize("script,args", [
    ("dflash-logs", ["--event", "train.step", "--json"]),
    ("dflash-status", ["--run", "latest", "--json"]),
])
def test_a_variable_of_another_command_changes_nothing(run_with_logs, script, args):
    cmd = SCRIPTS[script]
    clean = {k: None for k in os.environ if k.startswith("DFLASH_")}
    base = CliRunner().invoke(cmd, [*args, "--runs-dir", str(run_with_logs)], env=clean)
    assert base.exit_code == 0, base.output
    assert base.stdout.strip()
    if script == "dflash-logs":
        assert len(base.stdout.splitlines()) == 3  # one line per step
    noisy = {**clean, **_other_commands_variables(script)}
    assert "DFLASH_PRODUCE_INSTANCE" in noisy and "DFLASH_BROKER_SEED" in noisy
    other = CliRunner().invoke(cmd, [*args, "--runs-dir", str(run_with_logs)], env=noisy)
    assert other.exit_code == 0, other.output
    assert other.stdout == base.stdout


def test_its_own_variable_does_change_it(run_with_logs):
    """The namespaced variable is read: DFLASH_LOGS_INSTANCE filters dflash-logs."""
    clean = {k: None for k in os.environ if k.startswith("DFLASH_")}
    r = CliRunner().invoke(SCRIPTS["dflash-logs"], ["--event", "train.step", "--json", "--runs-dir", str(run_with_logs)],
                           env={**clean, "DFLASH_LOGS_INSTANCE": "prodA"})
    assert r.exit_code == 0 and r.stdout == "", r.output
