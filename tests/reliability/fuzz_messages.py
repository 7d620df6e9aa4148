"""Malformed messages for the broker's two sockets, from a seeded RNG.

Every message here must be refused: none may be a valid message that changes the run
(a valid `credit`, `lease`, `commit` or an acceptable batch). Each generator returns
(kind, frames); kinds are counted so a failure says which family broke the broker.
Written from PROTOCOL.md with msgpack alone, like the wire fakes.
"""

from __future__ import annotations

import random

import msgpack

ALIEN_RUN = "20200101T000000Z-dead"
HUGE = [2**39, 2**39]  # declares 2**79 elements: far past any limit, no bytes behind it
NO_LEASE = 10**9  # no run ever grants this many leases: a batch for it is always stale


def _pack(h) -> bytes:
    return msgpack.packb(h, use_bin_type=True)


def _tensors(T: int, width: int = 8) -> list[dict]:
    return [{"name": "input_ids", "dtype": "int32", "shape": [T]},
            {"name": "loss_mask", "dtype": "uint8", "shape": [T]},
            {"name": "hidden", "dtype": "bfloat16", "shape": [T, width]}]


def batch(run: str, producer: str, rng: random.Random, *, T: int = 4, **over) -> list[bytes]:
    """A well-formed batch for a lease nobody holds (stale), with fields overridden."""
    h = {"v": 1, "type": "batch", "run": run, "batch_id": f"fz-{rng.getrandbits(40)}", "producer": producer,
         "lease": NO_LEASE + rng.randrange(1000), "epoch": 0, "samples": [rng.randrange(64)], "seq_lens": [T],
         "layer_ids": [1, 2], "tensors": _tensors(T)}
    h.update(over)
    return [_pack(h), bytes(4 * T), bytes(T), bytes(16 * T)]


def _truncated(rng: random.Random, h: dict) -> bytes:
    raw = _pack(h)
    return raw[: rng.randrange(1, len(raw))]


def data_message(rng: random.Random, run: str, producers: list[str]) -> tuple[str, list]:
    """One malformed or stale message for data in."""
    p = rng.choice(producers + ["nobody", "x" * 5000])
    k = rng.randrange(12)
    if k == 0:
        return "random_bytes", [rng.randbytes(rng.randrange(1, 300))]
    if k == 1:
        return "truncated", [_truncated(rng, {"v": 1, "type": "batch", "run": run, "tensors": _tensors(4)})]
    if k == 2:
        return "not_a_map", [_pack(rng.choice([[1, 2], 7, "batch", None, 3.5]))]
    if k == 3:  # frame lengths that lie about the shapes
        f = batch(run, p, rng)
        f[rng.randrange(1, 4)] += b"\x00" * rng.randrange(1, 9)
        return "lying_sizes", f
    if k == 4:
        return "huge_shape", [_pack({"v": 1, "type": "batch", "run": run, "batch_id": "fz", "producer": p,
                                     "lease": 1, "epoch": 0, "samples": [1], "seq_lens": [1], "layer_ids": [1],
                                     "tensors": [{"name": "hidden", "dtype": "bfloat16", "shape": HUGE}]})]
    if k == 5:
        return "frame_count", batch(run, p, rng)[: rng.randrange(1, 4)] + [b"", b""] * rng.randrange(0, 3)
    if k == 6:
        return "bad_dtype", batch(run, p, rng, tensors=[{**t, "dtype": "float64"} for t in _tensors(4)])
    if k == 7:
        return "wrong_version", batch(run, p, rng, v=rng.choice([0, 2, "1", None]))
    if k == 8:
        return "other_run", batch(ALIEN_RUN, p, rng)
    if k == 9:  # header and tensors disagree
        return "inconsistent", batch(run, p, rng, seq_lens=[rng.choice([0, -1, 3, 5])], samples=[1, 2])
    if k == 10:
        return "stale_lease", batch(run, p, rng)
    return "too_many_frames", [_pack({"v": 1, "type": "batch", "run": run})] + [b"x"] * rng.randrange(17, 40)


def control_message(rng: random.Random, run: str, joined: bool) -> tuple[str, list]:
    """One malformed control message (from a session that said hello if `joined`)."""
    k = rng.randrange(12)
    if k == 0:
        return "random_bytes", [rng.randbytes(rng.randrange(1, 300))]
    if k == 1:
        return "truncated", [_truncated(rng, {"v": 1, "type": "ack", "run": run, "batch_ids": ["p1-1"], "step": 3})]
    if k == 2:
        return "not_a_map", [_pack(rng.choice([[1], 7, "hello", None, b"\x00\x01"]))]
    if k == 3:  # required fields of the wrong msgpack type
        t, f = rng.choice([("credit", {"credit": "x"}), ("credit", {"credit": -5}), ("lease", {"want": 2.5}),
                           ("ack", {"batch_ids": 3, "step": 1}), ("commit", {"step": "9", "checkpoint": 1}),
                           ("heartbeat", {"stats": [1]}), ("done", {"lease": "a", "skipped": []}),
                           ("bye", {"reason": 5})])
        return "wrong_types", [_pack({"v": 1, "type": t, "run": run, **f})]
    if k == 4:
        return "wrong_version", [_pack({"v": rng.choice([0, 2, "1", None, 1.0001]), "type": "status"})]
    if k == 5:
        return "other_run", [_pack({"v": 1, "type": "heartbeat", "run": ALIEN_RUN, "stats": {}})]
    if k == 6:
        return "unknown_type", [_pack({"v": 1, "type": rng.choice(["grant", "welcome", "batch", "x" * 400, 7]),
                                       "run": run})]
    if k == 7:
        return "ext_type", [_pack({"v": 1, "type": "status", "x": msgpack.ExtType(5, b"boom")})]
    if k == 8:
        return "bad_hello", [_pack({"v": 1, "type": "hello", "role": rng.choice(["admin", "consumer", 3]),
                                    "instance": rng.choice(["", "i" * 500, None]), "host": "h", "pid": 1})]
    if k == 9:  # tensors on the control socket, with lying shapes
        h = {"v": 1, "type": "heartbeat", "run": run, "stats": {}, "tensors": _tensors(4)}
        return "control_tensors", [_pack(h), b"\x00" * rng.randrange(0, 40)]
    if k == 10 and not joined:  # valid-looking but from nobody: unknown_peer
        return "unknown_peer", [_pack({"v": 1, "type": "ack", "run": run, "batch_ids": ["p1-1"], "step": 1})]
    return "many_frames", [_pack({"v": 1, "type": "bye", "run": run, "reason": "x"})] + [b"y"] * rng.randrange(1, 30)
