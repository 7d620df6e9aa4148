"""A minimal producer and consumer on the project's own client, `protocol.links`
(ProducerLink, ConsumerLink; tiny tensors, no model), run as processes by test_peerlink.py:

    python -m tests.broker.link_peers producer BROKER RUNS_DIR N_SAMPLES
    python -m tests.broker.link_peers consumer BROKER RUNS_DIR [IO_THREADS]
    python -m tests.broker.link_peers hold BROKER RUNS_DIR N_SAMPLES INBOX_BYTES

Exit 0 after a clean end of stream; the consumer prints one JSON line with what it got.
"""

from __future__ import annotations

import itertools
import json
import sys
import time

import torch
import zmq

from dflash.protocol.links import ConsumerLink, ProducerLink
from dflash.protocol.batch import Batch
from dflash.runtime.logs import close_logging, setup_logging

SEQ = 3


def produce(broker: str, runs_dir: str, n: int) -> None:
    cfg = {"target": "tiny", "layer_ids": [0, 1], "hidden_size": 4, "dataset": {"n_samples": n, "fingerprint": "x"}}
    link = ProducerLink(broker, "link-prod", config=cfg, runs_dir=runs_dir)
    link.start()
    seq = itertools.count()
    while not link.stopped.is_set():
        g = link.request_lease(8, timeout_s=10)
        if not g.samples:
            if g.end:
                break
            continue
        for s in g.samples:
            ids = torch.full((SEQ,), s, dtype=torch.int32)
            tensors = {"input_ids": ids, "loss_mask": torch.ones(SEQ, dtype=torch.uint8),
                       "hidden": torch.full((SEQ, 8), float(s), dtype=torch.bfloat16)}
            link.push_batch(Batch(f"{link.peer_id}-{next(seq)}", link.peer_id, g.lease, g.epoch, [s], [SEQ], [0, 1],
                                  tensors=tensors))
        link.lease_done(g.lease, [])
    streams = len(link.welcome.data_streams or [])
    link.close("done")
    print(json.dumps({"producer_streams": streams}), flush=True)


def consume(broker: str, runs_dir: str, io_threads: int = 0) -> None:
    link = ConsumerLink(broker, "link-cons", runs_dir=runs_dir, io_threads=io_threads)
    link.start()
    got, step = [], 0
    while True:
        msg = link.next_batch(timeout_s=0.2)
        if msg is None:
            if link.stopped.is_set():
                break
            continue
        s = msg.samples[0]
        ok = bool((msg.tensors["input_ids"] == s).all() and (msg.tensors["hidden"].float() == s).all())
        got.append((s, ok))
        step += 1
        link.ack([msg.batch_id], step)
    link.commit(step, f"ckpt/step-{step}")
    masks = [sock.getsockopt(zmq.AFFINITY) for sock in link._streams]  # each data stream's I/O thread
    link.close("done")
    print(json.dumps({"samples": sorted(s for s, _ in got), "all_ok": all(ok for _, ok in got),
                      "streams": link.stream_batches, "masks": masks}))


def hold(broker: str, runs_dir: str, n: int, inbox_bytes: int) -> None:
    """A consumer with `inbox_bytes` (and 2 I/O threads) that takes nothing until told:
    prints {"held": K, "io_threads": [control mask, data mask]} once
    its inbox stopped growing (1 s), waits for a line on stdin, then takes and acks all
    `n` batches and prints {"samples": [...]}."""
    link = ConsumerLink(broker, "link-hold", runs_dir=runs_dir, inbox_bytes=inbox_bytes, io_threads=2)
    link.start()
    last, since = -1, time.monotonic()
    while link.prefetched() == 0 or time.monotonic() - since < 1.0:
        if link.prefetched() != last:
            last, since = link.prefetched(), time.monotonic()
        time.sleep(0.02)
    io = [link._ctl.getsockopt(zmq.AFFINITY), link._data.getsockopt(zmq.AFFINITY)]  # ZeroMQ I/O thread masks
    print(json.dumps({"held": link.prefetched(), "io_threads": io}), flush=True)
    sys.stdin.readline()
    got = []
    while len(got) < n:
        msg = link.next_batch(timeout_s=10)
        if msg is None:
            break
        got.append(msg.samples[0])
        link.ack([msg.batch_id], len(got))
    link.commit(len(got), "ckpt")
    link.close("done")
    print(json.dumps({"samples": sorted(got)}), flush=True)


if __name__ == "__main__":
    role, broker, runs_dir = sys.argv[1:4]
    setup_logging(role, f"link-{role[:4]}", stream=sys.stderr)
    try:
        if role == "producer":
            produce(broker, runs_dir, int(sys.argv[4]))
        elif role == "hold":
            hold(broker, runs_dir, int(sys.argv[4]), int(sys.argv[5]))
        else:
            consume(broker, runs_dir, int(sys.argv[4]) if len(sys.argv) > 4 else 0)
    finally:
        close_logging()
