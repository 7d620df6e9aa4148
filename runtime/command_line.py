"""Shared CLI plumbing: every option has an env var `DFLASH_<COMMAND>_<NAME>` (e.g.
`DFLASH_PRODUCE_TOKEN_BUDGET`) and may come from a TOML file given with `--config`
(precedence: command line > env > config file > default). A few variables are shared by
every command on purpose (SHARED_ENV: the broker address, the runs folder, the Curve
keys); any other variable changes one command only. Each role keeps one frozen config
dataclass; the click command only maps options onto it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
import tomllib
from typing import Any, Callable

import click

DEFAULT_BROKER = "tcp://127.0.0.1:5555"

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tib": 1024**4}


def parse_bytes(text: str | int) -> int:
    """'4GiB', '512MB', '1048576' -> bytes. Raises ValueError."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 4GiB, 512MB, 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def size_option(_ctx, param, value: str | int | None) -> int | None:
    """click callback: a size option ('256MiB') as bytes, or a usage error naming the option."""
    if value is None:
        return None
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise click.BadParameter(str(e), param=param) from None


# Read by every command that has the option: one host's broker, runs folder and keys are
# the same for all its roles. Every other option's variable is DFLASH_<COMMAND>_<NAME>.
SHARED_ENV = frozenset({"DFLASH_BROKER", "DFLASH_RUNS_DIR", "DFLASH_CURVE_KEYS", "DFLASH_CURVE_NAME"})


def option(*decls: str, **kw) -> Callable:
    """click.option with its env var shown in --help, and defaults shown. The variable is
    DFLASH_<NAME> here; `command` puts the command's namespace in (unless shared)."""
    # "--elastic/--no-elastic" is one declaration: the variable is named after its on-switch.
    flag = next(d for d in decls if d.startswith("--")).split("/")[0]
    name = flag.lstrip("-").replace("-", "_").upper()
    kw.setdefault("envvar", f"DFLASH_{name}")
    kw.setdefault("show_envvar", True)
    kw.setdefault("show_default", True)
    return click.option(*decls, **kw)


def command(namespace: str, **settings) -> Callable:
    """click.command with `-h`/`--help` and every option's env var in the command's own
    namespace: DFLASH_<NAME> becomes DFLASH_<NAMESPACE>_<NAME> unless it is in SHARED_ENV
    (a DFLASH_INSTANCE meant for a producer once filtered dflash-logs' output to nothing)."""
    settings.setdefault("help_option_names", ["-h", "--help"])

    def wrap(f: Callable) -> click.Command:
        cmd = click.command(context_settings=settings)(f)
        for p in cmd.params:
            env = getattr(p, "envvar", None)
            if isinstance(env, str) and env.startswith("DFLASH_") and env not in SHARED_ENV:
                p.envvar = f"DFLASH_{namespace}_{env[len('DFLASH_'):]}"
        cmd.env_namespace = f"DFLASH_{namespace}_"
        return cmd

    return wrap


def default_instance(device: str) -> str:
    """A peer's default name, `<host>-<device>-<pid>` (e.g. `gpu3-cuda1-4711`): distinct
    for every process on a host, so two producers (or consumers) started with the same
    command on one host are not refused as duplicates. A restarted process gets a new name;
    nothing keys on the old one (the broker hands out ranks, checkpoints are per run)."""
    return f"{socket.gethostname()}-{device.replace(':', '')}-{os.getpid()}"


def _load_toml(ctx: click.Context, _param, path: str | None):
    if not path:
        return path
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise click.BadParameter(f"cannot read {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise click.BadParameter(f"{path} is not valid TOML: {e}") from None
    known = {p.name for p in ctx.command.params}
    flat = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(flat) - known)
    if unknown:
        raise click.BadParameter(f"{path}: unknown option(s) {', '.join(unknown)}")
    params = {p.name: p for p in ctx.command.params}
    for key, value in flat.items():
        _check_toml_value(path, key, value, params[key], ctx)
    ctx.default_map = {**(ctx.default_map or {}), **flat}
    return path


def _check_toml_value(path: str, key: str, value, param: click.Parameter, ctx: click.Context) -> None:
    """Refuse a TOML value its option cannot take, naming the file and key. Left to click,
    the error blamed the option's env var, which nobody had set; and a float given for an
    integer option was truncated without a word."""
    where = f"{path}: {key} = {value!r}"
    if isinstance(param.type, click.types.IntParamType) and isinstance(value, (float, bool)):
        raise click.BadParameter(f"{where} is not an integer (write it without a decimal point)")
    if isinstance(value, (dict, list)) and not param.multiple:
        raise click.BadParameter(f"{where} is a TOML {type(value).__name__}; --{key.replace('_', '-')} takes one value")
    try:
        param.type.convert(value, param, ctx)
        if param.callback is size_option and value is not None:
            parse_bytes(value)
    except click.BadParameter as e:
        raise click.BadParameter(f"{where}: {e.message}") from None
    except (ValueError, TypeError) as e:
        raise click.BadParameter(f"{where}: {e}") from None


def config_option() -> Callable:
    return option(
        "--config",
        type=click.Path(dir_okay=False),
        is_eager=True,
        expose_value=False,
        callback=_load_toml,
        help="TOML file of option values (keys as option names, e.g. token_budget = 4096).",
    )


def _broker_endpoint(_ctx, param, value: str | None) -> str | None:
    """click callback: --broker must be a ZeroMQ tcp:// endpoint (http:// gave a ZMQError traceback)."""
    if value is None:
        return value
    scheme = value.split("://", 1)[0] if "://" in value else None
    if scheme != "tcp" or not value[len("tcp://"):].strip("/"):
        raise click.BadParameter(f"{value!r} is not a broker control endpoint: expected tcp://HOST[:PORT] "
                                 "(the address dflash-broker binds with --port, e.g. tcp://10.0.0.5:5555)",
                                 param=param)
    return value


def broker_option() -> Callable:
    return option(
        "--broker",
        default=DEFAULT_BROKER,
        callback=_broker_endpoint,
        help="The broker's control endpoint tcp://HOST[:PORT] (port 5555 if omitted).",
    )


def curve_options(f: Callable) -> Callable:
    """The two options every peer command takes: `--curve-keys DIR` and `--curve-name NAME`
    (env DFLASH_CURVE_KEYS, DFLASH_CURVE_NAME, shared). Map them with curve.client_from."""
    f = option("--curve-name", default=None, metavar="NAME",
               help="Which keypair of --curve-keys is ours: DIR/NAME.key_secret (default: this host's name).")(f)
    return option("--curve-keys", default=None, metavar="DIR",
                  help="CurveZMQ on: encrypt and authenticate with DIR/broker.key and our keypair (made by "
                       "dflash-keygen; the broker must have our .key in its authorized/). Off = plain TCP.")(f)


def log_level_option() -> Callable:
    return option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]),
                  help="Lowest level logged.")


def runs_dir_option() -> Callable:
    return option(
        "--runs-dir", default="runs", type=click.Path(file_okay=False),
        help="Root folder of run folders (runs/<run_id>/...).",
    )


def target_callback(need_tokenizer: bool) -> Callable:
    """click callback of every --target: a local model folder or .gguf file, or a hub ID in
    the local Hugging Face cache (given on as its snapshot folder), checked before anything
    loads (runtime/target_arg.py says what transformers would have said instead)."""

    def check(_ctx, param, value: str | None) -> str | None:
        if value is None:
            return value
        from dflash.runtime.target_arg import looks_like_hub_id, resolve_hub_id, target_problem

        if looks_like_hub_id(value):
            try:
                value = resolve_hub_id(value)
            except FileNotFoundError as e:
                raise click.BadParameter(str(e), param=param) from None
        why = target_problem(str(value), hub_ok=True, need_tokenizer=need_tokenizer)
        if why is not None:
            raise click.BadParameter(why, param=param)
        return value

    return check


def target_option(help: str, required: bool = True, need_tokenizer: bool = True) -> Callable:
    """--target as every command takes it (one way to name a target: runtime/targets.py)."""
    return option("--target", required=required, default=None, callback=target_callback(need_tokenizer),
                  help=help + " A hub ID (org/name) must be in the local Hugging Face cache.")


def as_dict(cfg: Any) -> dict:
    """A frozen config dataclass as a plain dict for logging and run.json."""
    return dataclasses.asdict(cfg)


def fail(message: str, code: int = 2) -> None:
    """Exit with a one-line reason (DESIGN: bad input -> non-zero exit + one line)."""
    click.echo(f"error: {message}", err=True)
    sys.exit(code)

