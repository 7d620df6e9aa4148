"""Render docs/CLI.md: every option of every console script, read from the click commands.

    python -m dflash.tools.clidoc > docs/CLI.md

The commands are the `[project.scripts]` of pyproject.toml (or, for an installed wheel
without the source tree, the package's console-script entry points), so a new command is
documented as soon as it is declared. tests/tools/test_cli_docs.py checks that docs/CLI.md
is this module's output and that every option has help text.

The output must not depend on the machine that renders it: defaults computed from the home
folder, the working folder or the host name are written as `~`, `.` and `<host>` (a default
the command words itself, click's `show_default="..."`, is used as written).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import re
import socket
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import click

from dflash.runtime.command_line import SHARED_ENV

DIST = "dflash-pipeline"
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
REGENERATE = "python -m dflash.tools.clidoc > docs/CLI.md"
UNSET = getattr(click.core, "UNSET", None)  # click >= 8.3 marks "no default" with a sentinel
NONE = "—"


@dataclass(frozen=True)
class Script:
    name: str  # the console script, e.g. dflash-broker
    target: str  # module:attribute
    command: click.Command


def entry_points() -> list[tuple[str, str]]:
    """(script, "module:attr") in pyproject order; the installed metadata when there is no source tree."""
    if PYPROJECT.is_file():
        with open(PYPROJECT, "rb") as f:
            project = tomllib.load(f)["project"]
        if project["name"] == DIST:
            return list(project["scripts"].items())
    eps = importlib.metadata.distribution(DIST).entry_points
    return sorted((ep.name, ep.value) for ep in eps if ep.group == "console_scripts")


def load_command(script: str, target: str) -> click.Command:
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, click.Command):
        raise TypeError(f"{script} = {target!r}: {type(obj).__name__} is not a click command; clidoc documents click commands only")
    return obj


def scripts() -> list[Script]:
    return [Script(name, target, load_command(name, target)) for name, target in entry_points()]


def context(s: Script) -> click.Context:
    """A context carrying the command's own settings (help option names, env prefix), parsing nothing."""
    return click.Context(s.command, info_name=s.name, **s.command.context_settings)


# ---------------------------------------------------------------- machine independence


def portable(text: str) -> str:
    """`text` with this machine's home and working folder replaced by `~` and `.`.

    The deeper of the two goes first, so a default under the working folder reads `./...`
    wherever that is, and one under the home folder `~/...` even when run from home.
    """
    places = sorted([(str(Path.home()), "~"), (os.getcwd(), ".")], key=lambda pair: -len(pair[0]))
    for path, placeholder in places:  # sorted() is stable: with equal paths home wins
        if len(path) > 1:
            text = re.sub(re.escape(path) + r"(?![\w.-])", placeholder, text)
    return text


def portable_default(value: object) -> str:
    """A default value as text, home, working folder and host name as placeholders. The host
    name only in defaults: help text is written by people, and a host named like a word
    ('broker') would otherwise be replaced inside sentences."""
    text = portable(str(value))
    host = socket.gethostname()
    return re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w-])", "<host>", text) if host else text


# ---------------------------------------------------------------- markdown


def prose(text: str) -> str:
    """Help text as one table-safe markdown line (no HTML tags, no stray emphasis, no column breaks)."""
    text = " ".join(portable(text).split())
    return re.sub(r"([\\|<*])", r"\\\1", text)


def code(text: str) -> str:
    """A code span that survives a markdown table (GFM reads `\\|` as a literal pipe there)."""
    return "`" + text.replace("|", "\\|") + "`"


# ---------------------------------------------------------------- one option


def names(p: click.Option) -> str:
    metavar = f" {p.metavar}" if p.metavar and not p.is_flag else ""
    forms = [code(o + metavar) for o in p.opts] + [code(o) for o in p.secondary_opts]
    return ", ".join(forms)


def number_range(t: click.IntRange | click.FloatRange) -> str:
    bounds = []
    if t.min is not None:
        bounds.append(f"{'>' if t.min_open else '≥'} {t.min}")
    if t.max is not None:
        bounds.append(f"{'<' if t.max_open else '≤'} {t.max}")
    return f"{'integer' if isinstance(t, click.IntRange) else 'float'} {', '.join(bounds)}".strip()


def path_kind(t: click.Path) -> str:
    kind = "file" if not t.dir_okay else "folder" if not t.file_okay else "path"
    return f"{kind} (must exist)" if t.exists else kind


def type_text(p: click.Option) -> str:
    if p.count:
        return "count (repeat the flag)"
    if p.is_bool_flag:
        return "flag"
    if p.is_flag:
        return f"flag (sets {code(str(p.flag_value))})"
    t = p.type
    if isinstance(t, click.Choice):
        text = "one of " + ", ".join(code(str(c)) for c in t.choices)
    elif isinstance(t, (click.IntRange, click.FloatRange)):
        text = number_range(t)
    elif isinstance(t, click.Path):
        text = path_kind(t)
    else:
        text = t.name
    if p.nargs > 1:
        text = f"{p.nargs} × {text}"
    if getattr(p, "_flag_needs_value", False):  # `--watch` alone or `--watch 5`
        text += f"; value optional ({code(str(p.flag_value))} if omitted)"
    if p.multiple:
        text += "; repeatable"
    return text


def default_text(p: click.Option, ctx: click.Context) -> str:
    if p.required:
        return "required"
    if isinstance(p.show_default, str):  # the command's own words for a computed default
        return prose(p.show_default)
    value = p.get_default(ctx, call=False)
    if callable(value):
        return "computed at run time"
    if p.is_bool_flag:
        if p.secondary_opts:
            return code(p.opts[0] if value else p.secondary_opts[0])
        return "on" if value else "off"
    if value is None or value is UNSET or value == ():
        return NONE
    if isinstance(value, (list, tuple)):
        return ", ".join(code(portable_default(v)) for v in value)
    return code(portable_default(value))


def envvar_text(p: click.Option, ctx: click.Context) -> str:
    env = p.envvar
    if env is None and ctx.auto_envvar_prefix and p.allow_from_autoenv:
        env = f"{ctx.auto_envvar_prefix}_{p.name.upper()}"
    if not env:
        return NONE
    return ", ".join(code(e) for e in ([env] if isinstance(env, str) else env))


def option_row(p: click.Option, ctx: click.Context) -> str:
    cells = [names(p), type_text(p), default_text(p, ctx), envvar_text(p, ctx), prose(p.help or "")]
    return "| " + " | ".join(cells) + " |"


# ---------------------------------------------------------------- one command


def options(cmd: click.Command) -> list[click.Option]:
    return [p for p in cmd.params if isinstance(p, click.Option)]


def arguments(cmd: click.Command) -> list[click.Argument]:
    return [p for p in cmd.params if isinstance(p, click.Argument)]


def description(cmd: click.Command) -> list[str]:
    """The command's docstring as --help shows it: paragraphs, `\\f` and after cut off."""
    text = inspect.cleandoc(cmd.help or "").split("\f")[0].replace("\b\n", "")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]
    return [re.sub(r"([\\<*])", r"\\\1", portable(p)) for p in paragraphs]


def argument_lines(cmd: click.Command, ctx: click.Context) -> list[str]:
    lines = []
    for a in arguments(cmd):
        need = "required" if a.required else "optional"
        many = ", one or more" if a.nargs == -1 else ""
        kind = path_kind(a.type) if isinstance(a.type, click.Path) else a.type.name
        lines.append(f"- {code(a.make_metavar(ctx))}: {kind}, {need}{many} (described above)")
    return lines


def option_table(opts: list[click.Option], ctx: click.Context) -> list[str]:
    head = ["| option | type | default | env | meaning |", "| --- | --- | --- | --- | --- |"]
    return head + [option_row(p, ctx) for p in opts]


def render_command(s: Script) -> str:
    ctx = context(s)
    usage = " ".join([s.name, *s.command.collect_usage_pieces(ctx)])
    out = [f"## `{s.name}`", "", *sum(([p, ""] for p in description(s.command)), [])]
    out += [f"Usage: {code(usage)}. Help: {', '.join(code(n) for n in s.command.get_help_option_names(ctx))}. "
            f"Source: {code(s.target)}.", ""]
    if arguments(s.command):
        out += ["Arguments:", "", *argument_lines(s.command, ctx), ""]
    shown = [p for p in options(s.command) if not p.hidden]
    hidden = [p for p in options(s.command) if p.hidden]
    out += option_table(shown, ctx) + [""]
    if hidden:
        out += ["Hidden options (left out of `--help`: internal or for tests, not a stable interface):", ""]
        out += option_table(hidden, ctx) + [""]
    return "\n".join(out)


def undocumented(s: Script) -> list[str]:
    """What --help and docs/CLI.md would leave unexplained: options without help text, and
    arguments the description does not name (click arguments have no help of their own)."""
    missing = [f"{s.name} {p.opts[0]}: no help text" for p in options(s.command) if not (p.help or "").strip()]
    text = s.command.help or ""
    missing += [f"{s.name} {a.human_readable_name}: argument not named in the command's docstring"
                for a in arguments(s.command) if a.human_readable_name not in text]
    return missing


# ---------------------------------------------------------------- the page


def header(all_scripts: list[Script]) -> str:
    with_config = ", ".join(code(s.name) for s in all_scripts if any(p.name == "config" for p in options(s.command)))
    shared = ", ".join(code(e) for e in sorted(SHARED_ENV))
    return f"""# Command-line reference

Every option of every command, generated from the code by `{REGENERATE}`
(tests/tools/test_cli_docs.py fails when this file and the code disagree). `--help` on each
command says the same.

Options of the project's commands are read, highest precedence first, from:

1. the command line;
2. an environment variable, the `env` column: `DFLASH_<COMMAND>_<OPTION>`, in the command's
   own namespace (e.g. dflash-produce's `--token-budget` is `DFLASH_PRODUCE_TOKEN_BUDGET`), so
   a variable set for one command never changes another; shared on purpose by every command
   that has the option: {shared}; flags take `1`/`0`, `true`/`false`,
   `yes`/`no` or `on`/`off`, and a repeatable option takes space-separated values;
3. a TOML file given with `--config` (commands that have it: {with_config}), keys named
   as the options with `-` or `_` (`token_budget = 4096`); an unknown key is an error;
4. the default.

`{NONE}` in the env column: command line only; in the default column: none (the meaning
says what happens then). Defaults that depend on the machine are written with placeholders:
`~` is the home folder, `.` the working folder, `<host>` the host name.

Commands: {", ".join(f"[`{s.name}`](#{s.name})" for s in all_scripts)}.
"""


def render(all_scripts: list[Script] | None = None) -> str:
    all_scripts = scripts() if all_scripts is None else all_scripts
    return "\n".join([header(all_scripts), *(render_command(s) for s in all_scripts)]).rstrip("\n") + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
