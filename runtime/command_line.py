"""Shared CLI plumbing: each option is declared once as a config field (`setting`), has an env var
`DFLASH_<COMMAND>_<NAME>` (SHARED_ENV aside) and may come from a TOML `--config`
(command line > env > config file > default).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
import tomllib
import typing
from typing import Any, Callable, Mapping, Sequence

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


# One host's broker, runs folder and keys are the same for all its roles.
SHARED_ENV = frozenset({"DFLASH_BROKER", "DFLASH_RUNS_DIR", "DFLASH_CURVE_KEYS", "DFLASH_CURVE_NAME"})


def option(*decls: str, **kw) -> Callable:
    """click.option with its env var (DFLASH_<NAME>; `command` adds the namespace) and default shown."""
    flag = next(d for d in decls if d.startswith("--")).split("/")[0]
    name = flag.lstrip("-").replace("-", "_").upper()
    kw.setdefault("envvar", f"DFLASH_{name}")
    kw.setdefault("show_envvar", True)
    kw.setdefault("show_default", True)
    return click.option(*decls, **kw)


OPTION = "dflash.option"  # the metadata key of a field made by `setting`


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """What a config field says about its command-line option."""

    help: str
    text: Any  # the default as the command line writes it; dataclasses.MISSING: none (required)
    parse: Callable[[Any], Any] | None  # text -> the field's value, or None: click's type does it
    click_kwargs: dict  # further click.option arguments: type, metavar, required, callback, ...


def setting(default: Any = dataclasses.MISSING, *, help: str, parse: Callable[[Any], Any] | None = None,
            **click_kwargs) -> Any:
    """A config field that is also the option `--<field-name>`, declared once. With `parse`, `default`
    is command-line text (e.g. "4GiB") and the field holds parse(default)."""
    spec = OptionSpec(help, default, parse, click_kwargs)
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata={OPTION: spec})
    value = parse(default) if parse is not None and default is not None else default
    return dataclasses.field(default=value, metadata={OPTION: spec})


class Parsed:
    """click callback: the option's text through `parse` (a ValueError names the option)."""

    def __init__(self, parse: Callable[[Any], Any]):
        self.parse = parse

    def __call__(self, _ctx, param, value):
        if value is None:
            return None
        try:
            return self.parse(value)
        except ValueError as e:
            raise click.BadParameter(str(e), param=param) from None


def option_of(name: str, field: dataclasses.Field, annotation: Any = None, parse: bool = True) -> Callable:
    """The click option of `setting` field `name` (a bool is a flag; parse=False: `parse` left to the command)."""
    spec: OptionSpec = field.metadata[OPTION]
    kw = dict(spec.click_kwargs)
    flag = "--" + name.replace("_", "-")
    decls = [flag]
    if spec.text is not dataclasses.MISSING:
        kw["default"] = spec.text
    if spec.parse is not None and parse:
        kw.setdefault("callback", Parsed(spec.parse))
    base = _without_none(annotation)
    if base is bool and spec.text is True:
        decls = [f"{flag}/--no-{flag[2:]}"]
    elif base is bool:
        kw.setdefault("is_flag", True)
    elif base in (int, float) and spec.parse is None:
        kw.setdefault("type", base)
    return option(*decls, help=spec.help, **kw)


def _without_none(annotation: Any) -> Any:
    """`int | None` -> int; anything else as it is."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if len(args) == 1 and type(None) in typing.get_args(annotation) else annotation


def settings_of(cls: type) -> list[tuple[str, dataclasses.Field, Any]]:
    """(name, field, type) of every `setting` field of `cls` in order, nested configs' in their place."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += settings_of(hints[f.name])
        elif OPTION in f.metadata:
            out.append((f.name, f, hints[f.name]))
    return out


def options(cls: type, *, after: Mapping[str, Sequence[Callable | str]] | None = None, parse: bool = True) -> Callable:
    """Decorator: the click options of `cls` in field order; `after` places more options (or moved
    fields) after a field's. parse=False: values reach the command as text (`parse_texts`)."""
    made = {name: option_of(name, f, t, parse) for name, f, t in settings_of(cls)}
    after = dict(after or {})
    unknown = sorted(set(after) - set(made)) + sorted(x for xs in after.values() for x in xs
                                                       if isinstance(x, str) and x not in made)
    if unknown:
        raise ValueError(f"options({cls.__name__}): no such setting {', '.join(unknown)}")
    moved = {x for xs in after.values() for x in xs if isinstance(x, str)}
    ordered = []
    for name, decorator in made.items():
        if name not in moved:
            ordered.append(decorator)
            ordered += [made[x] if isinstance(x, str) else x for x in after.get(name, ())]

    def wrap(f: Callable) -> Callable:
        for decorator in reversed(ordered):  # click lists options in the order written above the function
            f = decorator(f)
        return f

    return wrap


def parse_texts(cls: type, values: Mapping[str, Any], namespace: str) -> dict:
    """`values` with each `parse` setting's text parsed; ValueError names the option, env var and --config."""
    out = dict(values)
    for name, f, _ in settings_of(cls):
        parse = f.metadata[OPTION].parse
        if parse is not None and out.get(name) is not None:
            try:
                out[name] = parse(out[name])
            except ValueError as e:
                raise ValueError(f"--{name.replace('_', '-')} (env DFLASH_{namespace}_{name.upper()}, "
                                 f"or --config): {e}") from None
    return out


def config_of(cls: type, values: Mapping[str, Any]) -> Any:
    """Config dataclass `cls` (and its nested configs) from a command's option values."""
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            kw[f.name] = config_of(hints[f.name], values)
        elif f.name in values:
            kw[f.name] = values[f.name]
    return cls(**kw)


def command(namespace: str, **settings) -> Callable:
    """click.command with `-h` and env vars in its own namespace (DFLASH_<NAMESPACE>_<NAME>, SHARED_ENV
    aside), so a variable meant for one command never changes another."""
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
    """A peer's default name, `<host>-<device>-<pid>`: distinct per process, so two peers started alike on
    one host are not refused as duplicates."""
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
    """Refuse a TOML value its option cannot take, naming the file and key (click blamed the env var)."""
    where = f"{path}: {key} = {value!r}"
    if isinstance(param.type, click.types.IntParamType) and isinstance(value, (float, bool)):
        raise click.BadParameter(f"{where} is not an integer (write it without a decimal point)")
    if isinstance(value, (dict, list)) and not param.multiple:
        raise click.BadParameter(f"{where} is a TOML {type(value).__name__}; --{key.replace('_', '-')} takes one value")
    try:
        param.type.convert(value, param, ctx)
        if isinstance(param.callback, Parsed) and value is not None:
            param.callback.parse(value)
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


# Options several commands share, each declared once.


def broker_setting() -> Any:
    return setting(DEFAULT_BROKER, callback=_broker_endpoint,
                   help="The broker's control endpoint tcp://HOST[:PORT] (port 5555 if omitted).")


def runs_dir_setting() -> Any:
    return setting("runs", type=click.Path(file_okay=False), help="Root folder of run folders (runs/<run_id>/...).")


def log_level_setting() -> Any:
    return setting("info", type=click.Choice(["debug", "info", "warning", "error"]), help="Lowest level logged.")


def curve_keys_setting() -> Any:
    """A peer's `--curve-keys DIR` (env DFLASH_CURVE_KEYS, shared); map it with curve.client_from."""
    return setting(None, metavar="DIR",
                   help="CurveZMQ on: encrypt and authenticate with DIR/broker.key and our keypair (made by "
                        "dflash-keygen; the broker must have our .key in its authorized/). Off = plain TCP.")


def curve_name_setting() -> Any:
    return setting(None, metavar="NAME",
                   help="Which keypair of --curve-keys is ours: DIR/NAME.key_secret (default: this host's name).")


def broker_option() -> Callable:
    return option_of("broker", broker_setting())


def curve_options(f: Callable) -> Callable:
    """The two options every peer command takes: `--curve-keys DIR` and `--curve-name NAME`."""
    f = option_of("curve_name", curve_name_setting())(f)
    return option_of("curve_keys", curve_keys_setting())(f)


def log_level_option() -> Callable:
    return option_of("log_level", log_level_setting())


def runs_dir_option() -> Callable:
    return option_of("runs_dir", runs_dir_setting())


def target_callback(need_tokenizer: bool) -> Callable:
    """click callback of every --target: a local folder, .gguf, or cached hub ID, checked before anything loads."""

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


def target_setting(help: str, required: bool = True, need_tokenizer: bool = True) -> Any:
    """--target as every command takes it (one way to name a target: runtime/targets.py)."""
    kw = dict(callback=target_callback(need_tokenizer), help=help + " A hub ID (org/name) must be in the local "
              "Hugging Face cache.")
    return setting(required=True, **kw) if required else setting(None, **kw)


def target_option(help: str, required: bool = True, need_tokenizer: bool = True) -> Callable:
    return option_of("target", target_setting(help, required, need_tokenizer))


def as_dict(cfg: Any) -> dict:
    """A frozen config dataclass as a plain dict for logging and run.json."""
    return dataclasses.asdict(cfg)


def fail(message: str, code: int = 2) -> None:
    """Exit with a one-line reason (DESIGN: bad input -> non-zero exit + one line)."""
    click.echo(f"error: {message}", err=True)
    sys.exit(code)

