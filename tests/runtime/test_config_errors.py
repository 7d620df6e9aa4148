"""Config errors name the option and where its value came from (issue 19, finding 9, the
option/env/TOML part): a TOML value of the wrong type is blamed on the file and key (not on
an env var nobody set), a TOML float for an integer option is refused (not truncated), and
a size from an env var that is not a size names the option."""

from __future__ import annotations

from click.testing import CliRunner

from dflash.broker.broker_command import main as broker_main
from dflash.producers.produce_command import main as produce_main
import pytest

pytestmark = pytest.mark.integration


def _clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("DFLASH_"):
            monkeypatch.delenv(k)


def test_a_toml_value_of_the_wrong_type_names_the_file_and_key(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    cfg = tmp_path / "p.toml"
    cfg.write_text('token_budget = "lots"\n')
    r = CliRunner().invoke(produce_main, ["--config", str(cfg), "--target", "x", "--data", "y"])
    assert r.exit_code == 2, r.output
    assert "DFLASH_PRODUCE_TOKEN_BUDGET" not in r.output  # nobody set it
    assert f"{cfg}: token_budget = 'lots'" in r.output and "integer" in r.output


def test_a_toml_float_for_an_integer_option_is_refused_not_truncated(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    cfg = tmp_path / "p.toml"
    cfg.write_text("token_budget = 4096.7\n")
    r = CliRunner().invoke(produce_main, ["--config", str(cfg), "--target", "x", "--data", "y"])
    assert r.exit_code == 2, r.output
    assert f"{cfg}: token_budget = 4096.7" in r.output and "not an integer" in r.output


def test_a_size_that_is_not_a_size_names_the_option_and_its_env_var(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    monkeypatch.setenv("DFLASH_BROKER_QUEUE_BYTES", "lots")
    r = CliRunner().invoke(broker_main, ["--runs-dir", str(tmp_path)])
    assert r.exit_code == 2, r.output
    assert "--queue-bytes" in r.output and "DFLASH_BROKER_QUEUE_BYTES" in r.output and "'lots' is not a size" in r.output


def test_a_broker_address_that_is_not_tcp_is_refused_naming_the_option(monkeypatch):
    _clean_env(monkeypatch)
    r = CliRunner().invoke(produce_main, ["--broker", "http://127.0.0.1:5555", "--target", "x", "--data", "y"])
    assert r.exit_code == 2 and "--broker" in r.output and "expected tcp://HOST[:PORT]" in r.output, r.output
    assert "ZMQError" not in r.output


def test_a_producer_target_that_is_no_model_folder_says_so(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    missing = tmp_path / "nope"
    r = CliRunner().invoke(produce_main, ["--target", str(missing), "--data", "y"])
    assert r.exit_code == 2 and f"{missing}: no such folder" in r.output and "Repo id" not in r.output, r.output
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(produce_main, ["--target", str(tmp_path / "empty"), "--data", "y"])
    assert r.exit_code == 2 and "is not a model folder: it has no config.json" in r.output, r.output
    assert "sentencepiece" not in r.output
