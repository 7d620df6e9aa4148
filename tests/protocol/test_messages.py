"""protocol/messages.py: each message type builds the header the codec sends and parses
it back to the same message; required fields are checked as the codec checks them;
optional ones are left out while None (unless nil) and take their default when absent."""

from __future__ import annotations

import pytest

from dflash.broker.inbound import Batch as Arrived
from dflash.protocol import codec
from dflash.protocol.errors import ProtocolError
from dflash.protocol.messages import MESSAGES, PRE_HANDSHAKE, Ack, Hello, LineageStart, Welcome

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
    b = Arrived.from_header({**h, "frames": ["x"], "payload_bytes": 7}, payload_bytes=1, header_bytes=2, frames=[])
    assert (b.payload_bytes, b.header_bytes, b.frames) == (1, 2, [])
