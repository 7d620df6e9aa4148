"""Sessions against BrokerCore in-process (broker/sessions.py, handshake.py, facts.py): what a
hello must be, retried and reconnected hellos, the bound on sessions, the run's facts and
target as producers and consumers state them, one model per run, ranks and the rendezvous,
data-out ports, heartbeats and `failed`, and what counts as a sign of life. The typed entry
points of tests/harness/core_rig.py, an injected clock, no sockets."""

from __future__ import annotations

import json

import pytest

from dflash.broker.actions import ClosePipes
from dflash.broker.peers import ConsumerSession, ProducerSession
from tests.harness.core_rig import N, Rig, codes, sent

pytestmark = pytest.mark.unit

TARGET = {"model_type": "llama", "config_sha256": "a" * 16, "heads_sha256": "b" * 16}
OTHER = {**TARGET, "heads_sha256": "c" * 16}


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def test_a_hello_retried_on_its_connection_gets_the_same_welcome_and_spends_no_id(rig):
    first = sent(rig.hello(b"prod", "producer", instance="t0"), "welcome")[0].fields
    again = sent(rig.hello(b"prod", "producer", instance="t0"), "welcome")[0].fields
    assert first == again and first["peer"] == "p1"
    out = rig.hello(b"prod", "consumer", instance="t0")  # the same connection as another role
    assert codes(out) == ["bad_message"] and "already joined as p1" in sent(out, "reject")[0].fields["reason"]
    assert sent(rig.hello(b"prod2", "producer"), "welcome")[0].fields["peer"] == "p2"


@pytest.mark.parametrize("bad,why", [
    ({"role": "status"}, "role 'status'"),
    ({"instance": ""}, "non-empty instance"),
    ({"instance": "x" * 129}, "non-empty instance"),
    ({"config": [1, 2]}, "a map config"),
], ids=["role", "empty_instance", "long_instance", "config_not_a_map"])
def test_a_hello_that_cannot_be_read_is_refused_naming_why(rig, bad, why):
    h = {"v": 1, "type": "hello", "role": "producer", "instance": "t0", "host": "h", "pid": 1, "config": {}, **bad}
    out = rig.send(b"x", h)
    assert codes(out) == ["bad_message"] and why in sent(out, "reject")[0].fields["reason"]
    assert rig.core.sessions.table.live() == []


def test_a_hello_config_over_64_kib_is_refused_without_echoing_it(rig):
    out = rig.hello(b"big", "consumer", blob="x" * (64 * 1024))
    rej = sent(out, "reject")[0].fields
    assert rej["code"] == "bad_message" and "larger than 65536 bytes" in rej["reason"]
    assert rej["answers"] == {"type": "hello"}  # the reject names the hello, not its megabytes


def test_the_session_bound_refuses_hellos_beyond_max_peers(tmp_path):
    with Rig(tmp_path, max_peers=2) as r:
        r.hello(b"a", "consumer")
        r.hello(b"b", "producer")
        assert codes(r.hello(b"c", "consumer")) == ["full"]
        r.control(b"a", "bye", reason="done")  # a session that left frees its place
        assert sent(r.hello(b"c", "consumer"), "welcome")[0].fields["peer"] == "c2"


def test_a_reconnect_with_another_curve_key_is_another_process(rig):
    rig.do(rig.core.on_hello(b"old", hello_msg("consumer", "gpu0", 77), rig.now, key="alice"))
    out = rig.do(rig.core.on_hello(b"new", hello_msg("consumer", "gpu0", 77), rig.now, key="mallory"))
    assert codes(out) == ["duplicate_instance"]
    out = rig.do(rig.core.on_hello(b"new", hello_msg("consumer", "gpu0", 77), rig.now, key="alice"))
    assert sent(out, "welcome")[0].fields["peer"] == "c1" and rig.peer(b"new").curve_key == "alice"


def hello_msg(role: str, instance: str, pid: int, **config):
    from dflash.protocol.messages import Hello

    h = {"v": 1, "type": "hello", "role": role, "instance": instance, "host": "testhost", "pid": pid,
         "config": config}
    return Hello.from_header(h)


def test_the_first_producer_fixes_the_dataset_when_the_broker_was_not_told(tmp_path):
    with Rig(tmp_path, num_samples=None) as r:
        out = r.hello(b"p0", "producer")
        assert codes(out) == ["config_mismatch"] and "must send config.dataset.n_samples" in \
            sent(out, "reject")[0].fields["reason"]
        assert codes(r.hello(b"p1", "producer", dataset={"n_samples": -3})) == ["config_mismatch"]
        w = sent(r.hello(b"p2", "producer", dataset={"n_samples": 12, "fingerprint": "f1"}), "welcome")[0].fields
        assert w["run_config"]["dataset"] == {"n_samples": 12, "fingerprint": "f1"}
        assert r.core.work.pool.n_samples == 12  # the lease pool is sized from it
        assert json.loads((r.core.run_dir / "run.json").read_text())["facts"]["dataset"]["n_samples"] == 12
        assert codes(r.hello(b"p3", "producer", dataset={"n_samples": 13})) == ["config_mismatch"]
        assert codes(r.hello(b"p4", "producer", dataset={"n_samples": 12, "fingerprint": "f2"})) == \
            ["config_mismatch"]
        assert sent(r.hello(b"p5", "producer", dataset={"n_samples": 12}), "welcome")  # no fingerprint: fine


def test_later_producers_must_state_the_runs_target_and_layers(rig):
    assert sent(rig.hello(b"p0", "producer", target="m", layer_ids=[1, 2], hidden_size=64), "welcome")
    for i, bad in enumerate(({"target": "other", "layer_ids": [1, 2], "hidden_size": 64},
                             {"target": "m", "layer_ids": [1, 3], "hidden_size": 64},
                             {"target": "m", "layer_ids": [1, 2]},  # hidden_size left out once known
                             {"target": "m", "layer_ids": [1, 2], "hidden_size": 0})):
        assert codes(rig.hello(f"bad{i}".encode(), "producer", **bad)) == ["config_mismatch"], bad
    assert rig.core.facts.facts.layer_ids == [1, 2] and [p.id for p in rig.core.sessions.table.live()] == ["p1"]


def test_a_producer_and_a_consumer_of_another_target_are_refused(rig):
    out = rig.hello(b"c0", "consumer", signal={"target": OTHER})
    assert sent(out, "welcome")  # no producer yet: nothing to compare with...
    out = rig.hello(b"p0", "producer", target_id=TARGET)  # ...but a producer is checked against it
    assert codes(out) == ["config_mismatch"] and "live consumer c1's target" in sent(out, "reject")[0].fields["reason"]
    rig.control(b"c0", "bye", reason="done")
    assert sent(rig.hello(b"p1", "producer", target_id=TARGET), "welcome")
    assert rig.core.facts.facts.target_id == TARGET
    assert codes(rig.hello(b"p2", "producer", target_id=OTHER)) == ["config_mismatch"]
    out = rig.hello(b"c1", "consumer", signal={"target": OTHER})
    assert codes(out) == ["config_mismatch"] and "this run's target (its producers')" in \
        sent(out, "reject")[0].fields["reason"]
    assert sent(rig.hello(b"c2", "consumer", signal={"target": TARGET}), "welcome")


def test_without_ranks_a_second_drafter_trainer_is_refused_unless_one_group(rig):
    assert sent(rig.hello(b"a", "consumer", signal={}), "welcome")
    out = rig.hello(b"b", "consumer", signal={})
    assert codes(out) == ["full"] and "--consumers N" in sent(out, "reject")[0].fields["reason"]
    assert sent(rig.hello(b"client", "consumer"), "welcome")  # a data client trains no model
    rig.control(b"a", "bye", reason="done")
    assert sent(rig.hello(b"r0", "consumer", signal={}, group={"rank": 0, "world_size": 2}), "welcome")
    assert sent(rig.hello(b"r1", "consumer", signal={}, group={"rank": 1, "world_size": 2}), "welcome")
    assert codes(rig.hello(b"r1b", "consumer", signal={}, group={"rank": 1, "world_size": 2})) == ["full"]


def test_rank_0s_rendezvous_goes_to_every_rank_in_its_welcome(tmp_path):
    with Rig(tmp_path, consumers=2, elastic=False) as r:
        w0 = sent(r.hello(b"r0", "consumer", dist_addr="10.0.0.1:29500"), "welcome")[0].fields["run_config"]
        w1 = sent(r.hello(b"r1", "consumer", dist_addr="10.0.0.2:29500"), "welcome")[0].fields["run_config"]
        assert (w0["rank"], w0["world_size"], w0["dist"]) == (0, 2, "tcp://10.0.0.1:29500")
        assert (w1["rank"], w1["dist"]) == (1, "tcp://10.0.0.1:29500")  # rank 0's, not its own
        assert "lighthouse" not in w1


def test_a_consumer_that_finds_too_few_free_ports_binds_none(tmp_path):
    r = Rig(tmp_path, data_out_ports=(7000, 7002), streams=2)  # --data-streams 2: two ports per consumer
    try:
        r.hello(b"a", "consumer")
        assert r.peer(b"a").pipes.ports == [7000, 7001]
        r.taken.add(7002)  # another process holds the last one
        out = r.hello(b"b", "consumer")
        assert codes(out) == ["full"] and "not 2 free data-out port(s) in 7000-7002" in \
            sent(out, "reject")[0].fields["reason"]
        assert [a.ports for a in out if isinstance(a, ClosePipes)] == []  # nothing was bound to let go
        r.taken.clear()
        out = r.hello(b"c", "consumer")
        assert codes(out) == ["full"]  # 7002 bound, then no second port: that one is closed again
        assert [a.ports for a in out if isinstance(a, ClosePipes)] == [(7002,)] and 7002 not in r.pipes
    finally:
        r.close()


def test_sessions_are_typed_by_role(rig):
    rig.hello(b"prod", "producer", target="m", layer_ids=[1], hidden_size=8, dataset={"n_samples": N})
    rig.hello(b"cons", "consumer", signal={"target": None}, lineages=True, group={"rank": 0, "world_size": 1})
    p, c = rig.peer(b"prod"), rig.peer(b"cons")
    assert isinstance(p, ProducerSession) and not hasattr(p, "credit") and p.said.layer_ids == [1]
    assert isinstance(c, ConsumerSession) and not hasattr(c, "batches_in")
    assert c.said.trains and c.said.lineages and (c.said.group.rank, c.said.group.world_size) == (0, 1)


def test_any_message_even_a_refused_one_keeps_a_session_alive(rig):
    rig.hello(b"prod", "producer")
    rig.control(b"prod", "credit", credit=1, now=rig.now + 9)  # not a producer's message: refused...
    rig.tick(rig.now + 11)
    assert "p1" in rig.core.sessions.table.by_id  # ...yet heard at +9: not silent at +11
    rig.tick(rig.now + 19.5)
    assert "p1" not in rig.core.sessions.table.by_id and rig.core.sessions.table.gone[-1].state == "lost"


def test_status_asks_are_not_counted_as_someone_taking_part(rig):
    rig.control(b"dflash-status", "status", run=None)
    assert rig.core.summary()["peer_messages"] == 0  # a run only status looked at stays empty
    rig.control(b"stranger", "lease", want=4)
    assert rig.core.summary()["peer_messages"] == 1


def test_heartbeat_figures_are_kept_bounded_and_shown_in_the_status_map(rig):
    rig.hello(b"cons", "consumer")
    stats = {"step": 7, "loss": 1.5, "nested": {"a": {"b": 1}}, "long": "x" * 500, **{f"k{i}": i for i in range(60)}}
    rig.control(b"cons", "heartbeat", stats=stats)
    kept = rig.peer(b"cons").stats
    assert kept["step"] == 7 and "nested" not in kept and len(kept["long"]) == 200 and len(kept) <= 48
    row = next(r for r in rig.status()["peers"] if r["peer"] == "c1")
    assert row["step"] == 7 and row["loss"] == 1.5 and row["stats_at"] is not None


def test_a_producers_failure_is_kept_for_the_status_map_after_it_leaves(rig):
    rig.hello(b"prod", "producer")
    rig.control(b"prod", "failed", code="bad_row", reason="chats.jsonl:17: invalid JSON", source="chats.jsonl:17",
                hint="fix the row")
    rig.control(b"prod", "bye", reason="failed")
    gone = rig.status()["gone"][-1]
    assert gone["state"] == "left" and gone["failure"] == {
        "code": "bad_row", "reason": "chats.jsonl:17: invalid JSON", "hint": "fix the row",
        "source": "chats.jsonl:17", "batch_id": None, "fault": None}
    assert gone["held"] == {"leases": [], "samples_returned": 0, "batches_in": 0}
