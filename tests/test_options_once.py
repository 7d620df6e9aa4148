"""Each option of dflash-broker, dflash-produce and dflash-consume is declared once (issue 37):
as a field of its role's frozen config, which holds its default, help and type; the click
command is made from the fields. Once the default was written twice, in a click option and in
the dataclass (103 of them), and the two could drift apart unseen."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import click
import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
OPTION = "dflash.option"  # the metadata key runtime/command_line.setting files a field's option under

# Options of a command that are no config field, each on purpose.
COMMAND_ONLY = {
    "dflash-broker": {"config"},  # a TOML file of option values: read by click, never configured
    "dflash-produce": {"config"},
    "dflash-consume": {"config", "device"},  # --device is made into ConsumerConfig.gpu
}
SOURCES = {"dflash-broker": "broker/broker_command.py", "dflash-produce": "producers/produce_command.py",
           "dflash-consume": "consumers/process/consume_command.py"}


def _role(script: str) -> tuple[click.Command, type]:
    """(the command, its config class)."""
    if script == "dflash-broker":
        from dflash.broker.broker_command import main
        from dflash.broker.config import BrokerConfig as config
    elif script == "dflash-produce":
        from dflash.producers.produce_command import main
        from dflash.producers.producer_config import ProducerConfig as config
    else:
        from dflash.consumers.process.consume_command import main
        from dflash.consumers.process.config import ConsumerConfig as config
    return main, config


def _fields(cls) -> dict[str, dataclasses.Field]:
    """Every field of config `cls`, those of a nested config (ConsumerConfig.train) in its place."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        out.update(_fields(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else {f.name: f})
    return out


def _options(cmd: click.Command) -> dict[str, click.Option]:
    return {p.name: p for p in cmd.params if isinstance(p, click.Option) and p.name != "help"}


@pytest.mark.parametrize("script", sorted(SOURCES))
def test_every_option_is_a_config_field_and_every_setting_an_option(script):
    cmd, cls = _role(script)
    fields = _fields(cls)
    options = _options(cmd)
    not_fields = sorted(set(options) - set(fields) - COMMAND_ONLY[script])
    assert not not_fields, f"{script} options that are no {cls.__name__} field: {not_fields}"
    plain = sorted(n for n in options if n in fields and OPTION not in fields[n].metadata)
    assert not plain, f"{cls.__name__} fields whose option is declared elsewhere, not with setting(): {plain}"
    missing = sorted(n for n, f in fields.items() if OPTION in f.metadata and n not in options)
    assert not missing, f"{cls.__name__} settings {script} has no option for: {missing}"


@pytest.mark.parametrize("script", sorted(SOURCES))
def test_every_default_and_help_comes_from_the_field(script):
    cmd, cls = _role(script)
    fields = _fields(cls)
    ctx = click.Context(cmd, info_name=script)
    for name, p in _options(cmd).items():
        if name in COMMAND_ONLY[script]:
            continue
        f, spec = fields[name], fields[name].metadata[OPTION]
        assert p.help == spec.help, name
        if p.required:
            assert f.default is dataclasses.MISSING, f"--{name} is required, yet {cls.__name__}.{name} has a default"
            continue
        # What the command gets when the option is not given: its default text, read as click reads it
        value = p.type_cast_value(ctx, p.get_default(ctx))
        if p.callback is not None:
            value = p.callback(ctx, p, value)
        elif spec.parse is not None:  # left to the command (the broker: parse_texts)
            value = spec.parse(value)
        assert value == f.default, f"{script} --{name}: the option gives {value!r}, {cls.__name__}.{name} is {f.default!r}"


def _declared_options(source: str) -> dict[str, list[str]]:
    """{option name: keyword arguments} of every option declared in `source` (option("--x", ...),
    click.option(...)), read from the code, not from the command it makes."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if func != "option":
            continue
        for arg in node.args:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--"):
                name = arg.value.split("/")[0][2:].replace("-", "_")
                out[name] = [k.arg for k in node.keywords]
    return out


@pytest.mark.parametrize("script", sorted(SOURCES))
def test_no_command_module_declares_a_config_fields_option_again(script):
    """The command modules hold no option of a config field, so no second default: the
    fixture of issue 37, where every default was written in both places."""
    source = (ROOT / SOURCES[script]).read_text()
    declared = _declared_options(source)
    _, cls = _role(script)
    twice = sorted(set(declared) & set(_fields(cls)))
    assert not twice, f"{SOURCES[script]} declares options of {cls.__name__} fields again: {twice}"
    assert set(declared) <= COMMAND_ONLY[script], f"{SOURCES[script]}: options beyond {COMMAND_ONLY[script]}"


def test_the_source_scan_sees_a_repeated_default():
    """The scan above finds the way options were written before issue 37."""
    before = ('@option("--bind", default="*", help="Interface.")\n'
              '@click.option("--elastic/--no-elastic", default=True)\n'
              'def main(**opts):\n    pass\n')
    assert _declared_options(before) == {"bind": ["default", "help"], "elastic": ["default"]}


def test_a_setting_written_as_text_holds_the_parsed_value():
    """A size or range is written once, as on the command line; the field holds its value."""
    from dflash.broker.config import BrokerConfig
    from dflash.consumers.process.config import ConsumerConfig
    from dflash.consumers.training.config import TrainConfig

    broker = _fields(BrokerConfig)
    assert broker["queue_bytes"].default == 4 << 30 and broker["queue_bytes"].metadata[OPTION].text == "4GiB"
    assert broker["data_out_ports"].default == (5557, 5620)
    assert _fields(ConsumerConfig)["inbox_bytes"].default == 256 << 20
    assert TrainConfig().target_layers is None and TrainConfig().precision == "auto"


def test_a_value_that_does_not_parse_is_refused_naming_the_option():
    """The consumer parses in click (a usage error); the broker in broker_config (one line
    naming where the value may have come from)."""
    from click.testing import CliRunner

    broker, _ = _role("dflash-broker")
    r = CliRunner().invoke(broker, ["--data-out-ports", "high"])
    assert r.exit_code == 2 and "error: --data-out-ports (env DFLASH_BROKER_DATA_OUT_PORTS, or --config): " \
        "'high' is not a port range like 5557-5620" in r.output, r.output
    consume, _ = _role("dflash-consume")
    r = CliRunner().invoke(consume, ["--inbox-bytes", "lots", "--target-layers", "1,2"])
    assert r.exit_code == 2 and "Invalid value for '--inbox-bytes'" in r.output and "'lots' is not a size" in r.output
    r = CliRunner().invoke(consume, ["--target-layers", "1,x"])
    assert r.exit_code == 2 and "'1,x' is not a comma-separated list of layer IDs" in r.output, r.output


def test_options_keep_the_order_they_are_declared_in():
    """--help lists a config's options in field order, and `after` places others between them."""
    from dflash.runtime.command_line import option, options, setting

    # Made with make_dataclass: a class written in this function would have annotations
    # (strings here) that name classes no module holds.
    inner = dataclasses.make_dataclass("Inner", [("b", int, setting(2, help="B.")),
                                                 ("on", bool, setting(True, help="On."))], frozen=True)
    Outer = dataclasses.make_dataclass("Outer", [("a", str, setting("x", help="A.")), ("inner", inner),
                                                 ("c", float | None, setting(None, help="C.")),
                                                 ("quiet", bool, setting(False, help="Quiet."))],
                                       frozen=True, kw_only=True)

    @click.command()
    @options(Outer, after={"a": [option("--extra", default=None, help="E.")], "b": ["quiet"]})
    def cmd(**kw):
        """Example."""

    params = [(p.opts + p.secondary_opts, p.type.name, p.default) for p in cmd.params]
    assert params == [(["--a"], "text", "x"), (["--extra"], "text", None), (["--b"], "integer", 2),
                      (["--quiet"], "boolean", False), (["--on", "--no-on"], "boolean", True),
                      (["--c"], "float", None)]
    with pytest.raises(ValueError, match="no such setting nope"):
        options(Outer, after={"nope": []})
