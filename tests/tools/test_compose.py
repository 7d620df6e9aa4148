"""docker-compose.yml is parsed (no Docker engine here) and checked against the real CLIs:
every service's command is an invocation our click commands accept, with the service's
environment applied, and ports and addresses agree."""

from pathlib import Path

import click
import pytest
import yaml

from dflash.broker.broker_command import main as broker_main
from dflash.consumers.process.consume_command import main as consume_main
from dflash.producers.produce_command import main as produce_main

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {"dflash-broker": broker_main, "dflash-produce": produce_main, "dflash-consume": consume_main}


@pytest.fixture
def mounts(tmp_path):
    (tmp_path / "models" / "target").mkdir(parents=True)
    # --target must look like a model folder: config, weights and tokenizer files (not read here)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / "models" / "target" / name).write_text("{}")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("")
    return tmp_path


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _parse(service: dict, monkeypatch, mounts: Path) -> click.Context:
    name, *args = service["command"]
    # The container sees its volumes at /models and /data; stand them in with real folders
    # so options that must name an existing path are checked too.
    args = [str(mounts) + a if a.startswith(("/models", "/data")) else a for a in args]
    assert name in COMMANDS, f"{name} is not one of our commands"
    for k in list(__import__("os").environ):
        if k.startswith("DFLASH_"):
            monkeypatch.delenv(k)
    for k, v in (service.get("environment") or {}).items():
        cmd_opts = {p.envvar for p in COMMANDS[name].params if isinstance(p, click.Option)}
        assert k in cmd_opts, f"{name} has no option read from env var {k}"
        monkeypatch.setenv(k, str(v))
    return COMMANDS[name].make_context(name, list(args))  # raises on unknown/invalid options


def _target(volume: str) -> str:
    """Container path of a `host:container[:ro]` volume (the host side may hold `${X:-y}`)."""
    return volume.removesuffix(":ro").removesuffix(":rw").rsplit(":", 1)[1]


def test_every_service_is_a_valid_invocation(compose, monkeypatch, mounts):
    assert set(compose["services"]) >= {"broker", "producer", "consumer"}
    for svc in compose["services"].values():
        with monkeypatch.context() as m:
            _parse(svc, m, mounts)


def test_ports_addresses_gpus_and_volumes_agree(compose, monkeypatch, mounts):
    svcs = compose["services"]
    broker = _parse(svcs["broker"], monkeypatch, mounts).params
    published = {p.split(":")[1] for p in svcs["broker"]["ports"]}
    assert str(broker["port"]) in published and str(broker["data_in_port"]) in published
    lo, hi = (int(x) for x in str(broker["data_out_ports"]).split("-"))
    assert f"{lo}-{hi}" in published
    assert broker["advertise_host"] == "broker"
    for name in ("producer", "consumer"):
        svc = svcs[name]
        assert svc["environment"]["DFLASH_BROKER"] == f"tcp://broker:{broker['port']}"
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices and "gpu" in devices[0]["capabilities"]
        assert "broker" in svc["depends_on"]
    mounts = [{_target(v) for v in s["volumes"]} for s in svcs.values()]
    assert all("/runs" in m for m in mounts)
    assert all(s["environment"].get("DFLASH_RUNS_DIR") == "/runs" for s in svcs.values())
