"""docs/CLI.md documents every option of every console script, and stays true.

It is generated from the click commands themselves (dflash.tools.clidoc); these tests fail
when the code and the file disagree, when an option has no help text (it would be blank in
both --help and CLI.md), and when the file would differ from one machine to another.
"""

import os
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import click

from dflash.runtime.command_line import option
from dflash.tools import clidoc
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CLI_MD = ROOT / "docs" / "CLI.md"
FIX = "run python -m dflash.tools.clidoc > docs/CLI.md"


def test_cli_md_is_the_generators_output():
    assert CLI_MD.read_text() == clidoc.render(), f"docs/CLI.md is out of date: {FIX}"


def test_every_project_script_has_a_section():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    headings = [line for line in CLI_MD.read_text().splitlines() if line.startswith("## ")]
    assert headings == [f"## `{name}`" for name in scripts], FIX


def test_every_option_has_help_text_and_every_argument_is_described():
    missing = [m for s in clidoc.scripts() for m in clidoc.undocumented(s)]
    assert not missing, "explain these in the command's code (help= / docstring), then " + FIX + ":\n" + "\n".join(missing)


def test_output_does_not_depend_on_home_or_working_folder(tmp_path):
    """The committed file must come out the same on the coordinator's machine and in CI."""
    elsewhere = tmp_path / "another-home"
    elsewhere.mkdir()
    env = {**os.environ, "HOME": str(elsewhere)}
    out = subprocess.run([sys.executable, "-m", "dflash.tools.clidoc"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert str(elsewhere) not in out.stdout
    assert out.stdout == CLI_MD.read_text(), FIX


# ------------------------------------------------ the generator on a command made here


def _script(command: click.Command) -> clidoc.Script:
    return clidoc.Script("dflash-example", "tests:example", command)


def test_an_option_without_help_and_an_unnamed_argument_are_reported():
    @click.command()
    @click.argument("src")
    @option("--fuse", is_flag=True)
    @option("--eval-every", default=0, type=int, help="  ")
    @option("--ok", default=1, type=int, help="Fine.")
    def example(src, fuse, eval_every, ok):
        """Does something."""

    assert clidoc.undocumented(_script(example)) == [
        "dflash-example --fuse: no help text",
        "dflash-example --eval-every: no help text",
        "dflash-example SRC: argument not named in the command's docstring",
    ]


def test_machine_defaults_flags_choices_and_hidden_options_render():
    host = socket.gethostname()

    @click.command(context_settings={"help_option_names": ["-h", "--help"]})
    @click.argument("out_dir", type=click.Path(file_okay=False))
    @option("--cache", default=str(Path.home() / ".cache" / "x"), help="Cache folder.")
    @option("--name", default=f"{host}-gpu0", help="Name.")
    @option("--mode", default="a", type=click.Choice(["a", "b"]), help="Mode a|b.")
    @option("--pack/--no-pack", default=False, help="Pack.")
    @option("--level", default=3, type=click.IntRange(1, 5), help="Level.")
    @option("--secret-knob", default=1, hidden=True, help="For tests.")
    @click.option("--plain", help="No env var: plain click.option.")
    def example(**_):
        """Writes OUT_DIR."""

    text = clidoc.render_command(_script(example))
    lines = text.splitlines()
    row = {line.split(" | ")[0].lstrip("| "): line for line in lines if line.startswith("| `")}
    assert "`~/.cache/x`" in row["`--cache`"] and str(Path.home()) not in text
    if len(host) > 2:
        assert "`<host>-gpu0`" in row["`--name`"]
    assert "one of `a`, `b`" in row["`--mode`"] and "Mode a\\|b." in row["`--mode`"]
    assert row["`--pack`, `--no-pack`"].split(" | ")[2] == "`--no-pack`"
    assert "integer ≥ 1, ≤ 5" in row["`--level`"] and "`DFLASH_LEVEL`" in row["`--level`"]
    assert row["`--plain`"].split(" | ")[3] == "—"
    assert "Usage: `dflash-example [OPTIONS] OUT_DIR`. Help: `-h`, `--help`." in text
    assert "- `OUT_DIR`: folder, required (described above)" in lines
    hidden_at = lines.index(next(line for line in lines if line.startswith("Hidden options")))
    assert lines.index(row["`--secret-knob`"]) > hidden_at > lines.index(row["`--plain`"])


def test_every_env_var_is_a_name_a_shell_can_set():
    """`--x/--no-x` flags once got `DFLASH_X/__NO_X`, which no shell can export."""
    import re

    bad = [(s.name, p.name, p.envvar) for s in clidoc.scripts() for p in s.command.params
           if isinstance(p, click.Option) and isinstance(p.envvar, str)
           and not re.fullmatch(r"DFLASH_[A-Z0-9_]+", p.envvar)]
    assert not bad


def test_an_on_off_flag_reads_its_env_var(monkeypatch):
    @click.command()
    @option("--elastic/--no-elastic", default=True, help="On or off.")
    def cmd(elastic):
        click.echo(f"elastic={elastic}")

    from click.testing import CliRunner

    assert CliRunner().invoke(cmd, [], env={"DFLASH_ELASTIC": "0"}).output.strip() == "elastic=False"
    assert CliRunner().invoke(cmd, [], env={"DFLASH_ELASTIC": "1"}).output.strip() == "elastic=True"
