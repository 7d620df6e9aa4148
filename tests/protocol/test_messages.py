"""protocol/messages.py: each message type builds the header the codec sends and parses
it back to the same message; required fields are checked as the codec checks them;
optional ones are left out while None (unless nil) and take their default when absent."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dflash.protocol import codec
from dflash.protocol.errors import ProtocolError
from dflash.protocol.messages import (MESSAGES, PRE_HANDSHAKE, Ack, CommitPoint, DatasetFacts, Grant, Hello, LineageStart,
                                     RunConfig, RunFacts, Welcome)

pytestmark = pytest.mark.unit

RUN = "20261202T000000Z-test"
SAMPLE = {str: "x", int: 3, float: 1.5, bool: True, list: [1, 2], dict: {"a": 1}}


def example(cls):
    """`cls` with every required field set to a value of its wire type, optional ones unset."""
    return cls(**{f.name: SAMPLE[f.type] for f in cls.wire_fields() if not f.metadata.get("optional")})


@pytest.mark.parametrize("t", sorted(MESSAGES))
def test_every_type_goes_through_the_codec_and_back(t):
    cls = MESSAGES[t]
    msg = example(cls)
    h = msg.to_header(None if t in PRE_HANDSHAKE else RUN)
    assert h["v"] == 1 and h["type"] == t
    got = codec.unpack_header(codec.encode(h)[0])
    codec.check_header(got, run=RUN)  # the codec's checks pass (a batch's tensors aside)
    assert cls.from_header(got) == msg and cls.from_header(got).raw == got


def test_required_fields_are_checked_with_the_codecs_words():
    with pytest.raises(ProtocolError, match=r"ack: missing field 'step'"):
        Ack.from_header({"v": 1, "type": "ack", "run": RUN, "batch_ids": []})
    with pytest.raises(ProtocolError, match=r"ack: field 'step' has type bool"):
        Ack.from_header({"v": 1, "type": "ack", "run": RUN, "batch_ids": [], "step": True})
    with pytest.raises(ProtocolError, match=r"ack: missing field 'step'"):
        codec.check_header({"v": 1, "type": "ack", "run": RUN, "batch_ids": []})


def test_optional_fields_left_out_while_none_unless_nil():
    assert "lineage" not in Ack(["b"], 1).to_header(RUN)
    assert Ack(["b"], 1, "L").to_header(RUN)["lineage"] == "L"
    h = LineageStart("L", 0).to_header(RUN)  # parent and checkpoint go out as nil (PROTOCOL.md 4.5)
    assert h["parent"] is None and h["checkpoint"] is None
    h = Hello("producer", "i", "h", 1).to_header()
    assert h["gpu"] is None and h["config"] == {} and "run" not in h


def test_welcome_and_hello_carry_run_as_their_own_field():
    h = Welcome(RUN, "p1", 1.0, 10.0, data_in="tcp://x:1").to_header()
    assert h["run"] == RUN and "data_out" not in h
    assert Hello("producer", "i", "h", 1, run=RUN).to_header()["run"] == RUN


def test_absent_optional_fields_take_their_default_and_parse():
    h = {"v": 1, "type": "hello", "role": "producer", "instance": "i", "host": "h", "pid": 1,
         "gpu": "cuda0", "config": None, "unknown": 1}
    m = Hello.from_header(h)
    assert m.gpu is None and m.config == {} and m.run is None  # a non-int gpu is none; nil config a map


def test_a_header_naming_a_local_field_does_not_reach_it():
    h = example(MESSAGES["batch"]).to_header(RUN)
    b = MESSAGES["batch"].from_header({**h, "tensors": [{"name": "input_ids"}]})  # the codec's tensor specs
    assert b.tensors == {} and b.raw["tensors"] == [{"name": "input_ids"}]


# ---------------------------------------------------------------- maps inside a message: welcome.run_config

RUN_CONFIG = RunConfig(epochs=2, seed=7, lease_size=4, max_message_bytes=1 << 20, max_credit=64)


def test_a_run_config_goes_out_as_a_map_and_parses_back():
    rc = replace(RUN_CONFIG, layer_ids=[1, 3], dataset=DatasetFacts(10, "fp"),
                 resumed_from=CommitPoint(RUN, 4, "/ckpt/step-4"), rank=1, world_size=2, dist="tcp://h:1")
    h = Welcome(RUN, "c1", 1.0, 10.0, run_config=rc).to_header()
    assert h["run_config"]["dataset"] == {"n_samples": 10, "fingerprint": "fp"}
    assert h["run_config"]["resumed_from"] == {"run": RUN, "step": 4, "checkpoint": "/ckpt/step-4"}
    got = Welcome.from_header(codec.unpack_header(codec.encode(h)[0]))
    assert got.run_config == rc and got.run_config.names_start()


def test_a_run_config_says_nil_where_a_field_applies_and_is_unknown():
    """PROTOCOL.md 4.1: a resumed run's `resumed_from` is nil when its chain committed
    nothing, `dist` is nil where ranks are arranged and rank 0 offered none; elsewhere absent."""
    fresh = RUN_CONFIG.fields()
    assert "resumed_from" not in fresh and "dist" not in fresh and "parent_run" not in fresh
    assert not RunConfig.from_header(fresh).names_start()  # a fresh run: --resume as the consumer gives it
    resumed = replace(RUN_CONFIG, parent_run="20261201T000000Z-aaaa").fields()
    assert resumed["resumed_from"] is None
    back = RunConfig.from_header(resumed)
    assert back.names_start() and back.resumed_from is None  # start from no checkpoint
    ranked = replace(RUN_CONFIG, rank=0, world_size=2).fields()
    assert ranked["dist"] is None and "lighthouse" not in ranked


def test_a_heartbeats_run_facts_fill_in_what_the_welcome_lacked():
    facts = RunFacts.from_header({"layer_ids": [1, 2], "hidden_size": 64, "target_id": None})
    rc = RUN_CONFIG.with_facts(facts)
    assert (rc.layer_ids, rc.hidden_size, rc.target_id, rc.seed) == ([1, 2], 64, None, 7)


def test_a_grants_samples_must_be_ids():
    h = Grant(1, 0, [3, 4], False).to_header(RUN)
    assert Grant.from_header(h).samples == [3, 4]
    with pytest.raises(ProtocolError, match="grant: field 'samples' holds an element of type bool"):
        codec.check_header({**h, "samples": [3, True]})
