"""The broker's policy against BrokerCore in-process: no sockets, no broker process.

Each test drives the core with the headers a peer would send (through the codec's checks
and the typed entry points, tests/harness/core_rig.py, so the validation order is the real
one), real batches' header fields, a real SQLite ledger
in tmp_path, and checks what the core decided: the actions it returned, its phase, the
ledger's counts and rows, the queue and the lease pool.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash.broker.actions import ClosePipes
from dflash.broker.config import MAX_CREDIT
from dflash.broker.inbound import Unreadable
from dflash.broker.phase import Phase
from dflash.protocol.messages import Bye, Credit
from dflash.protocol.sample_order import epoch_order
from tests.harness.core_rig import N, RUN, Rig, codes, ledger_states, sent

pytestmark = pytest.mark.unit

@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


# ---------------------------------------------------------------- the module itself


def test_core_imports_no_zmq_in_a_fresh_interpreter():
    code = ("import sys, dflash.broker.core, dflash.broker.inbound, dflash.broker.actions; "
            "bad = sorted(m for m in sys.modules if m == 'zmq' or m.startswith('zmq.')); print(bad); "
            "sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"dflash.broker.core imported {r.stdout.strip()} {r.stderr[-400:]}"


# ---------------------------------------------------------------- handshake


def test_hello_welcomes_peers_with_fresh_ids_and_a_bound_pipe(rig):
    w = sent(rig.hello(b"prod", "producer"), "welcome")[0].fields
    assert w["peer"] == "p1" and w["run"] == RUN and w["data_in"] == "tcp://testhost:5556"
    w = sent(rig.hello(b"cons", "consumer"), "welcome")[0].fields
    assert w["peer"] == "c1" and w["data_out"] == "tcp://testhost:7000"
    assert rig.peer(b"cons").pipes.ports == [7000] and sorted(rig.pipes) == [7000]  # bound by the server
    assert w["run_config"]["max_credit"] == 64 and w["run_config"]["epochs"] == 1


def test_duplicate_instance_is_refused_and_spends_no_peer_id(rig):
    rig.hello(b"c-a", "consumer", instance="gpu0")
    out = rig.hello(b"c-b", "consumer", instance="gpu0")  # another pid: another process
    assert codes(out) == ["duplicate_instance"] and not sent(out, "welcome")
    assert [p.id for p in rig.core.sessions.table.live()] == ["c1"]
    assert len(rig.bound) == 1  # no pipe was bound for the refused one
    assert sent(rig.hello(b"c-c", "consumer", instance="gpu1"), "welcome")[0].fields["peer"] == "c2"


def test_same_process_on_a_new_connection_keeps_its_session(rig):
    rig.hello(b"old", "consumer", instance="gpu0", pid=4242)
    c = rig.peer(b"old")
    out = rig.hello(b"new", "consumer", instance="gpu0", pid=4242)
    assert sent(out, "welcome")[0].fields["peer"] == "c1" and sent(out, "welcome")[0].identity == b"new"
    assert rig.core.sessions.table.by_identity == {b"new": c} and c.identity == b"new"


def test_wrong_run_and_wrong_version_are_refused_before_anything_else(rig):
    rig.hello(b"prod", "producer")
    assert codes(rig.control(b"prod", "lease", run="someone-elses-run", want=4)) == ["run_mismatch"]
    assert codes(rig.control(b"prod", "lease", v=99, want=4)) == ["version"]
    assert rig.core.work.pool.open == {} and rig.core.ledger.counts["leased"] == 0


def test_unknown_peer_bad_header_and_wrong_role_are_refused(rig):
    assert codes(rig.control(b"stranger", "lease", want=4)) == ["unknown_peer"]
    assert codes(rig.core.on_unreadable(b"x", Unreadable("bad_message", "header is not valid msgpack"), rig.now)) == ["bad_message"]
    rig.hello(b"prod", "producer")
    out = rig.control(b"prod", "ack", batch_ids=["p1-1"], step=1)
    assert codes(out) == ["bad_message"] and "not accepted from a producer" in sent(out, "reject")[0].fields["reason"]
    out = rig.send(b"prod", {"v": 1, "type": "lease", "run": RUN})  # the codec: lease: missing field 'want'
    assert codes(out) == ["bad_message"]  # the codec's refusal, answered after the run check


def test_ranks_are_handed_out_and_a_full_group_is_refused(tmp_path):
    with Rig(tmp_path, consumers=2, elastic=False) as r:
        ranks = [sent(r.hello(i, "consumer"), "welcome")[0].fields["run_config"]["rank"] for i in (b"a", b"b")]
        assert ranks == [0, 1]
        assert codes(r.hello(b"c", "consumer")) == ["full"]
        r.control(b"a", "bye", reason="done")  # a lost rank's number goes to the next to join
        assert sent(r.hello(b"d", "consumer"), "welcome")[0].fields["run_config"]["rank"] == 0


def test_pipe_ports_rotate_and_skip_a_port_another_process_holds(rig):
    rig.taken.add(7000)
    rig.hello(b"c-a", "consumer")
    rig.hello(b"c-b", "consumer")
    assert rig.peer(b"c-a").pipes.ports == [7001] and rig.peer(b"c-b").pipes.ports == [7002]
    out = rig.control(b"c-a", "bye", reason="x")
    assert any(isinstance(a, ClosePipes) and a.ports == (7001,) for a in out) and 7001 not in rig.pipes
    rig.hello(b"c-c", "consumer")  # not 7001: a lost-but-running consumer may still dial it
    assert rig.peer(b"c-c").pipes.ports == [7003]


# ---------------------------------------------------------------- leases and batches


def test_grant_follows_the_epoch_order_and_a_batch_is_queued_once(rig):
    p, grant = rig.produce()
    assert grant["lease"] == 1 and grant["samples"] == epoch_order(0, 0, N)[:4] and grant["end"] is False
    assert len(rig.core.delivery.queue) == 1 and rig.core.ledger.counts["produced"] == 4
    rig.batch(p, 1, 0, grant["samples"], batch_id="again")  # the same samples again: stale
    rig.batch(p, 1, 0, grant["samples"], batch_id=f"{p}-1-{grant['samples'][0]}")
    assert len(rig.core.delivery.queue) == 1 and rig.core.ledger.counts["produced"] == 4
    assert rig.peer(b"prod").stale == 2
    assert 1 not in rig.core.work.pool.open  # every sample arrived: the lease is complete


def test_a_batch_from_no_live_producer_or_for_samples_not_leased_is_dropped(rig):
    rig.batch("p9", 1, 0, [0, 1])  # no such session
    rig.hello(b"prod", "producer")
    g1 = sent(rig.control(b"prod", "lease", want=2), "grant")[0].fields
    rig.hello(b"prod2", "producer")
    g2 = sent(rig.control(b"prod2", "lease", want=2), "grant")[0].fields
    p2 = rig.peer(b"prod2").id
    rig.batch(p2, g1["lease"], 0, g1["samples"])  # another producer's lease
    rig.batch(p2, g2["lease"], 0, [g2["samples"][0], N + 5])  # a sample its lease does not hold
    rig.batch(p2, g2["lease"], 1, g2["samples"])  # the wrong epoch
    assert len(rig.core.delivery.queue) == 0 and rig.core.ledger.counts["produced"] == 0
    assert rig.peer(b"prod2").stale == 3
    assert rig.core.work.pool.open[g2["lease"]].outstanding == set(g2["samples"])  # nothing half-recorded
    rig.batch(p2, g2["lease"], 0, g2["samples"])
    assert len(rig.core.delivery.queue) == 1 and rig.core.ledger.counts["produced"] == 2


def test_a_lost_producers_leases_go_back_to_the_front_of_the_pool(rig):
    rig.hello(b"prod", "producer")
    grant = sent(rig.control(b"prod", "lease", want=4), "grant")[0].fields
    pending = rig.core.work.pool.pending()
    rig.control(b"prod", "bye", reason="killed")
    assert rig.core.work.pool.pending() == pending + 4 and rig.core.work.pool.open == {}
    rig.hello(b"prod2", "producer")
    again = sent(rig.control(b"prod2", "lease", want=4), "grant")[0].fields
    assert again["samples"] == grant["samples"] and again["lease"] == 2


def test_done_with_samples_missing_is_given_back_after_the_timeout(rig):
    rig.hello(b"prod", "producer")
    grant = sent(rig.control(b"prod", "lease", want=4), "grant")[0].fields
    p = rig.peer(b"prod").id
    rig.batch(p, 1, 0, grant["samples"][:2])
    rig.control(b"prod", "done", lease=1, skipped=[])
    t0 = rig.advance(0.01)
    rig.control(b"prod", "heartbeat", stats={}, now=t0 + 9)  # alive: only its lease is late
    rig.tick(t0 + 5)
    assert 1 in rig.core.work.pool.open  # within the grace
    rig.tick(t0 + 11)
    assert 1 not in rig.core.work.pool.open and rig.core.work.pool.pending() == N - 4 + 2
    assert rig.core.sessions.table.by_id.get(p) is not None


# ---------------------------------------------------------------- exactly once


def test_credit_dispatch_ack_and_commit_move_samples_through_the_ledger(rig):
    p, grant = rig.produce()
    c = rig.consumer()
    sent_ = rig.dispatch()
    bid = f"{p}-1-{grant['samples'][0]}"
    assert [r.batch_id for r in sent_] == [bid] and rig.pipe(b"cons").sent == [bid]
    assert rig.peer(b"cons").credit == 7 and rig.core.ledger.counts["delivered"] == 4
    rig.control(b"cons", "ack", batch_ids=[bid], step=1)
    assert rig.core.ledger.counts["trained"] == 4 and not rig.peer(b"cons").in_flight
    assert rig.core.delivery.queue.in_flight_bytes == 0 and bid in rig.core.commits.trained
    rig.control(b"cons", "commit", step=1, checkpoint="ckpt/step1")
    assert rig.core.ledger.counts["committed"] == 4 and rig.core.ledger.counts["trained"] == 0
    assert ledger_states(rig.core) == {"committed": 4} and rig.core.ledger.last_commit == (1, "ckpt/step1")
    assert c == "c1"


def test_commit_moves_only_what_was_trained_up_to_its_step(rig):
    p, g1 = rig.produce()
    _, g2 = rig.produce()
    rig.consumer()
    rig.dispatch()
    b1, b2 = f"{p}-1-{g1['samples'][0]}", f"{p}-2-{g2['samples'][0]}"
    rig.control(b"cons", "ack", batch_ids=[b1], step=1)
    rig.control(b"cons", "ack", batch_ids=[b2], step=2)
    rig.control(b"cons", "commit", step=1, checkpoint="ckpt/1")
    assert rig.core.ledger.counts["committed"] == 4 and list(rig.core.commits.trained) == [b2]
    assert ledger_states(rig.core) == {"committed": 4, "trained": 4}


def test_an_ack_of_an_unknown_batch_moves_nothing(rig):
    rig.produce()
    rig.consumer()
    rig.dispatch()
    rig.control(b"cons", "ack", batch_ids=["no-such-batch", 17], step=1)
    assert rig.core.ledger.counts["trained"] == 0 and len(rig.peer(b"cons").in_flight) == 1


def test_a_lost_consumers_batches_are_requeued_first_and_its_pipes_closed(rig):
    p, g1 = rig.produce()
    rig.produce()
    rig.consumer(credit=1)
    rig.dispatch()
    held = list(rig.peer(b"cons").in_flight)
    pipe = rig.pipe(b"cons")
    t0 = rig.advance(0.01)
    rig.control(b"prod", "heartbeat", stats={}, now=t0 + 10.5)
    out = rig.tick(t0 + 11)  # the consumer is silent past timeout_s
    assert rig.core.sessions.table.gone[-1].id == "c1" and rig.core.sessions.table.gone[-1].state == "lost"
    assert any(isinstance(a, ClosePipes) and a.ports == (pipe.port,) for a in out) and pipe.closed
    assert rig.core.delivery.queue.peek().batch_id == held[0] and len(rig.core.delivery.queue) == 2
    assert rig.core.ledger.counts["delivered"] == 0 and rig.core.ledger.counts["produced"] == 8
    rig.consumer(b"cons2", credit=4)  # the next consumer gets the returned batch first
    assert [r.batch_id for r in rig.dispatch()][0] == held[0]


def test_a_consumer_that_heartbeats_but_never_acks_is_lost_at_its_ack_deadline(tmp_path):
    with Rig(tmp_path, ack_timeout_s=5.0) as r:
        r.produce()
        r.consumer()
        r.dispatch()
        t0 = r.advance(0.01)
        for dt in (2, 4):
            r.control(b"cons", "heartbeat", stats={"step": 0}, now=t0 + dt)
            r.tick(t0 + dt)
        assert "c1" in r.core.sessions.table.by_id  # within the deadline
        r.control(b"cons", "heartbeat", stats={"step": 0}, now=t0 + 6)
        r.tick(t0 + 6)
        assert "c1" not in r.core.sessions.table.by_id and "no ack" in r.core.sessions.table.gone[-1].gone_reason
        assert len(r.core.delivery.queue) == 1 and r.core.ledger.counts["delivered"] == 0


def test_an_ack_after_the_commit_that_holds_it_is_committed_at_once(rig):
    p, g1 = rig.produce()
    _, g2 = rig.produce()
    rig.consumer(b"r0", credit=1)
    rig.consumer(b"r1", credit=1)
    rig.dispatch()
    (b0,), (b1,) = list(rig.peer(b"r0").in_flight), list(rig.peer(b"r1").in_flight)
    rig.control(b"r0", "ack", batch_ids=[b0], step=3)
    rig.control(b"r0", "commit", step=3, checkpoint="ckpt/3")  # rank 0 commits step 3...
    assert rig.core.ledger.counts["committed"] == 4
    rig.control(b"r1", "ack", batch_ids=[b1], step=3)  # ...rank 1's ack of step 3 comes after
    assert rig.core.ledger.counts["committed"] == 8 and not rig.core.commits.trained
    assert ledger_states(rig.core) == {"committed": 8}


def test_commits_of_a_superseded_lineage_are_refused_and_what_it_alone_held_is_rewound(rig):
    p, g1 = rig.produce()
    _, g2 = rig.produce()
    rig.consumer(b"old", credit=2)
    rig.control(b"old", "lineage", lineage="A", step=0)
    rig.dispatch()
    b1, b2 = list(rig.peer(b"old").in_flight)
    rig.control(b"old", "ack", batch_ids=[b1], step=1, lineage="A")
    rig.control(b"old", "ack", batch_ids=[b2], step=3, lineage="A")
    pending = rig.core.work.pool.pending()
    rig.consumer(b"new", credit=2)  # restarts from A's checkpoint of step 1
    rig.control(b"new", "lineage", lineage="B", parent="A", step=1, checkpoint="ckpt/1")
    assert list(rig.core.commits.trained) == [b1]  # B's weights hold step 1 of A, not step 3
    assert rig.core.work.pool.pending() == pending + 4 and rig.core.ledger.counts["trained"] == 4
    out = rig.control(b"old", "commit", step=3, checkpoint="ckpt/A3", lineage="A")
    assert codes(out) == ["lineage_superseded"] and "c1" not in rig.core.sessions.table.by_id
    assert rig.core.ledger.counts["committed"] == 0
    rig.control(b"new", "commit", step=1, checkpoint="ckpt/B1", lineage="B")  # its start: nothing acked yet
    assert rig.core.ledger.counts["committed"] == 4 and rig.core.commits.lineages.last_commit_lineage == "B"


# ---------------------------------------------------------------- end of stream, shutdown, phases


def drain_to_trained(rig, commit: bool = True):
    """Produce every sample, train and (optionally) commit them."""
    for _ in range(N // 4):
        rig.produce()
    rig.consumer()
    rig.dispatch()
    ids = list(rig.peer(b"cons").in_flight)
    rig.control(b"cons", "ack", batch_ids=ids, step=1)
    if commit:
        rig.control(b"cons", "commit", step=1, checkpoint="ckpt/1")


def test_end_of_stream_tells_everyone_to_stop_then_completes_when_they_leave(rig):
    drain_to_trained(rig)
    assert rig.core.life.phase is Phase.RUNNING
    t0 = rig.advance(0.01)
    out = rig.tick(t0)
    assert rig.core.life.phase is Phase.ENDING and rig.core.life.end.reason == "end_of_stream"
    assert sorted(a.identity for a in sent(out, "stop")) == [b"cons", b"prod"]
    assert sent(rig.control(b"prod", "lease", want=4), "grant")[0].fields["end"] is True
    out = rig.hello(b"late", "consumer")  # a joiner is told to stop too
    assert sent(out, "welcome") and sent(out, "stop")[0].fields["reason"] == "end_of_stream"
    for who in (b"prod", b"cons", b"late"):
        rig.control(who, "bye", reason="stop")
    rig.tick(t0 + 1)
    assert rig.core.life.phase is Phase.DONE and rig.core.outcome == "completed"
    assert rig.status()["broker"]["state"] == "stopping"


def test_a_run_whose_every_sample_was_skipped_ends_as_nothing_to_train(rig):
    rig.hello(b"prod", "producer")
    for lease in (1, 2):
        g = sent(rig.control(b"prod", "lease", want=4), "grant")[0].fields
        rig.control(b"prod", "done", lease=g["lease"], skipped=[[s, "too_long"] for s in g["samples"]])
        assert g["lease"] == lease
    rig.tick(rig.advance(0.01))
    assert rig.core.life.phase is Phase.ENDING
    rig.control(b"prod", "bye", reason="stop")
    rig.tick(rig.now + 1)
    assert rig.core.life.phase is Phase.DONE and rig.core.outcome == "nothing_to_train"
    assert "skipped" in rig.core.life.end.outcome_why


def test_a_signal_drains_peers_serving_commits_but_sending_no_batch(rig):
    drain_to_trained(rig, commit=False)
    t0 = rig.advance(0.01)
    rig.core.on_signal("SIGTERM", 1)
    out = rig.tick(t0)
    assert rig.core.life.phase is Phase.DRAINING and rig.core.life.end.reason == "shutdown"
    assert {a.fields["reason"] for a in sent(out, "stop")} == {"shutdown"} and len(sent(out, "stop")) == 2
    assert not sent(rig.control(b"prod", "lease", want=4), "grant")[0].fields["samples"]
    rig.control(b"cons", "commit", step=1, checkpoint="ckpt/last")  # the last commit is still recorded
    assert rig.core.ledger.counts["committed"] == 8
    rig.tick(t0 + 0.5)
    assert rig.core.life.phase is Phase.DRAINING  # peers are still there
    rig.control(b"cons", "bye", reason="stop")
    rig.control(b"prod", "bye", reason="stop")
    rig.tick(t0 + 1)
    assert rig.core.life.phase is Phase.DONE and rig.core.outcome == "interrupted"


def test_no_batch_goes_out_while_draining(rig):
    rig.produce()
    rig.core.on_signal("SIGINT", 1)
    rig.tick(rig.advance(0.01))
    rig.consumer()  # joins during the drain: told to stop, given nothing
    assert rig.dispatch() == [] and len(rig.core.delivery.queue) == 1
    assert rig.pipe(b"cons").sent == []


def test_the_drain_ends_at_drain_s_or_at_a_second_signal(tmp_path):
    for second in (False, True):
        r = Rig(tmp_path / str(second), drain_s=30.0)
        try:
            r.consumer()
            t0 = r.advance(0.01)
            r.core.on_signal("SIGTERM", 1)
            r.tick(t0)
            r.control(b"cons", "heartbeat", stats={}, now=t0 + 5)
            r.tick(t0 + 5)
            assert r.core.life.phase is Phase.DRAINING
            if second:
                r.core.on_signal("SIGTERM", 2)
                r.tick(t0 + 6)
            else:
                r.control(b"cons", "heartbeat", stats={}, now=t0 + 29)
                r.tick(t0 + 29)
                assert r.core.life.phase is Phase.DRAINING
                r.tick(t0 + 31)
            assert r.core.life.phase is Phase.DONE and r.core.outcome == "interrupted"
            assert "c1" in r.core.sessions.table.by_id  # it never left: the drain gave up on it
        finally:
            r.close()


def test_a_first_signal_during_end_of_stream_changes_nothing_a_second_drains(rig):
    drain_to_trained(rig)
    t0 = rig.advance(0.01)
    rig.tick(t0)
    assert rig.core.life.phase is Phase.ENDING
    rig.core.on_signal("SIGTERM", 1)
    rig.tick(t0 + 0.1)
    assert rig.core.life.phase is Phase.ENDING
    rig.core.on_signal("SIGTERM", 2)
    rig.tick(t0 + 0.2)  # a second signal: the drain ends at once, peers or not
    assert rig.core.life.end.reason == "shutdown" and rig.core.life.phase is Phase.DONE
    assert rig.core.outcome == "interrupted"


def test_the_job_lost_with_uncommitted_work_refuses_consumers(tmp_path):
    with Rig(tmp_path, num_samples=16) as r:
        r.produce()
        r.consumer()
        r.dispatch()
        r.control(b"cons", "ack", batch_ids=list(r.peer(b"cons").in_flight), step=1)
        r.control(b"cons", "bye", reason="crashed")  # trained 4 samples, committed none
        assert r.core.life.phase is Phase.JOB_LOST and r.core.life.job_lost.trained == 4
        assert codes(r.hello(b"cons2", "consumer")) == ["job_lost"]
        st = r.status()
        assert st["broker"]["state"] == "job_lost" and st["job_lost"]["peer"] == "c1"
        assert st["progress"]["eta_s"] is None
        r.tick(r.advance(0.01))
        assert r.core.life.phase is Phase.JOB_LOST  # not the end of the stream: samples are left


def test_a_consumer_leaving_after_a_commit_of_everything_loses_no_job(rig):
    rig.produce()
    rig.consumer()
    rig.dispatch()
    rig.control(b"cons", "ack", batch_ids=list(rig.peer(b"cons").in_flight), step=1)
    rig.control(b"cons", "commit", step=1, checkpoint="ckpt/1")
    rig.control(b"cons", "bye", reason="restart")
    assert rig.core.life.phase is Phase.RUNNING and rig.core.life.job_lost is None
    w = sent(rig.hello(b"cons2", "consumer"), "welcome")[0].fields
    assert w["run_config"]["resumed_from"] == {"run": RUN, "step": 1, "checkpoint": "ckpt/1"}


def test_heartbeats_carry_the_last_commit_and_the_run_facts(rig):
    rig.hello(b"prod", "producer", layer_ids=[1, 2], hidden_size=64)
    assert json.loads((rig.core.run_dir / "run.json").read_text())["facts"]["layer_ids"] == [1, 2]
    rig.consumer()
    out = rig.tick(rig.now + 1.5)
    beats = sent(out, "heartbeat")
    assert sorted(a.identity for a in beats) == [b"cons", b"prod"]
    stats = beats[0].fields["stats"]
    assert stats["run_facts"]["layer_ids"] == [1, 2] and stats["last_commit"] is None
    assert stats["samples_total"] == N and stats["max_credit"] == 64


# ---------------------------------------------------------------- typed entry points, data-in checks


def test_the_typed_entry_points_do_what_the_routed_messages_do(rig):
    rig.hello(b"cons", "consumer")
    c = rig.peer(b"cons")
    assert rig.core.on_credit(b"cons", Credit(5), rig.now) == [] and c.credit == 5
    rig.core.on_credit(b"cons", Credit(500), rig.now)
    assert c.credit == MAX_CREDIT  # capped
    out = rig.core.on_credit(b"cons", Credit(-1, raw={"type": "credit", "credit": -1}), rig.now)
    assert codes(out) == ["bad_message"] and c.credit == MAX_CREDIT
    out = rig.do(rig.core.on_bye(b"cons", Bye("done"), rig.now))
    assert "c1" not in rig.core.sessions.table.by_id and rig.core.sessions.table.gone[-1].state == "left"
    assert any(isinstance(a, ClosePipes) for a in out)


def test_status_is_answered_before_any_handshake(rig):
    out = rig.control(b"dflash-status", "status", run=None)
    st = sent(out, "status_reply")[0].fields["status"]
    assert st["run_id"] == RUN and st["broker"]["state"] == "running" and st["samples"]["total"] == N


def test_a_batch_over_max_message_bytes_is_dropped_and_its_producer_told(tmp_path):
    r = Rig(tmp_path, max_message_bytes=50)  # the rig's batches carry 100 tensor bytes
    try:
        r.hello(b"prod", "producer")
        g = sent(r.control(b"prod", "lease", want=4), "grant")[0].fields
        out = r.batch(r.peer(b"prod").id, g["lease"], 0, g["samples"])
        rej = sent(out, "reject")
        assert [a.fields["code"] for a in rej] == ["too_large"] and rej[0].identity == b"prod"
        assert rej[0].fields["answers"]["type"] == "batch"
        assert len(r.core.delivery.queue) == 0 and r.core.work.pool.open[g["lease"]].outstanding == set(g["samples"])
    finally:
        r.close()


def test_a_batch_of_other_target_layers_is_dropped(rig):
    rig.hello(b"prod", "producer", layer_ids=[3, 4])
    g = sent(rig.control(b"prod", "lease", want=4), "grant")[0].fields
    rig.batch(rig.peer(b"prod").id, g["lease"], 0, g["samples"])  # the rig's batches say [1, 2]
    assert len(rig.core.delivery.queue) == 0 and rig.core.ledger.counts["produced"] == 0


def test_an_elastic_consumer_announcing_its_lineage_takes_over_a_lost_job(tmp_path):
    r = Rig(tmp_path, num_samples=16, consumers=2)
    r.core.use_lighthouse("tcp://testhost:29510")  # elastic: the server started a lighthouse
    try:
        r.produce()
        r.consumer(lineages=True)
        r.control(b"cons", "lineage", lineage="A", step=0)
        r.dispatch()
        r.control(b"cons", "ack", batch_ids=list(r.peer(b"cons").in_flight), step=1, lineage="A")
        r.control(b"cons", "bye", reason="crashed")
        assert r.core.life.phase is Phase.JOB_LOST
        assert codes(r.hello(b"plain", "consumer")) == ["job_lost"]  # no lineage: refused
        pending = r.core.work.pool.pending()
        r.consumer(b"new", lineages=True)  # starts from nothing: what A alone held is made again
        r.control(b"new", "lineage", lineage="B", step=0)
        assert r.core.life.phase is Phase.RUNNING and r.core.life.job_lost is None
        assert r.core.work.pool.pending() == pending + 4 and not r.core.commits.trained
        assert r.core.ledger.counts["trained"] == 0
    finally:
        r.close()
