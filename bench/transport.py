"""Transport benchmark on loopback: memcpy ceiling vs direct PUSH->PULL vs through the broker.

    python bench/transport.py                      # 1, 16, 64, 256 MiB; ~1.5 min on 2 cores
    python bench/transport.py --repeat 3           # medians of 3 (the tables in docs/BENCHMARKS.md)
    python bench/transport.py --sizes 64 --gb 4 --out /tmp/t.json

For each batch size, in the same run:
  memcpy   one core copying the same bytes: into a preallocated buffer (`warm`), and into a
           freshly allocated one (`fresh`: what a receiver pays when every message is new
           memory, as ZeroMQ's are: page faults included);
  direct   two processes, PUSH -> PULL, the producer's and consumer's socket options,
           codec.encode / codec.decode, copy=False both sides;
  broker   producer process (ProducerLink) -> real `dflash-broker` process -> consumer process
           (ConsumerLink: credit, ack per batch, commit at end of stream); once per value of
           --broker-io-threads (e.g. 1,2: the broker's ZeroMQ I/O threads, side by side).
A batch is header + input_ids + loss_mask + hidden [T, 5*4096] bf16 frames, as producers
send. CPU columns are seconds of CPU per GB moved, per process (every thread): on a
machine with a core per process, 1 / (cpu s/GB) is the rate that process could reach.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import common
from common import RESULTS, Broker, CpuSampler, batch_tensors, machine, payload_bytes, result, spawn, table, write_json
from dflash.protocol.sockets import AUTO_DATA_STREAMS, free_port_block
from dflash.runtime.command_line import parse_bytes

PEERS = str(Path(__file__).resolve().parent / "transport_peers.py")


def memcpy(nbytes: int, min_s: float = 0.3) -> dict:
    """GB/s of one core copying `nbytes`: warm (preallocated destination) and fresh."""
    torch.set_num_threads(1)  # ZeroMQ moves a message on one I/O thread: compare like with like
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the destination's pages once
    out = {}
    for name, fn in (("warm", lambda: dst.copy_(src)), ("fresh", lambda: bytearray(src.numpy().data))):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < min_s or n < 3:
            fn()
            n += 1
        out[name] = n * nbytes / (time.perf_counter() - t0) / 1e9
    return out


def direct(mib: float, n: int, warm: int, a) -> dict:
    port = free_port_block(1)
    knobs = ["--io-threads", str(a.io_threads), "--sndbuf", str(a.sndbuf), "--rcvbuf", str(a.rcvbuf)]
    recv = spawn([sys.executable, PEERS, "direct-recv", "--port", str(port), "--n", str(n), "--warm", str(warm),
                  "--rcvhwm", str(a.credit + 1), *knobs])
    send = spawn([sys.executable, PEERS, "direct-send", "--port", str(port), "--n", str(n), "--warm", str(warm),
                  "--mib", str(mib), "--sndhwm", str(a.sndhwm), *knobs, *fresh(a)])
    cpu = CpuSampler().watch(send.pid, recv.pid)
    try:
        r, _ = result(recv, 300), result(send, 300)
    finally:
        cpu.stop()
    return {**r, "cores": {"send": cpu.busy(send.pid, r["t0"], r["t1"]), "recv": cpu.busy(recv.pid, r["t0"], r["t1"])}}


def through_broker(mib: float, n: int, warm: int, a, runs: Path, io_threads: str = "") -> dict:
    io = ["--io-threads", io_threads] if io_threads else []
    b = Broker(runs, AUTO_DATA_STREAMS, "--num-samples", str(n + warm), "--lease-size", "256", "--queue-bytes", a.queue_bytes,
               "--heartbeat-s", "1", "--timeout-s", "60", *io, *a.broker_arg)
    cpu = CpuSampler().watch(b.proc.pid, threads=True)
    procs = []
    try:
        common = ["--broker", b.control, "--runs-dir", str(runs), "--io-threads", str(a.io_threads)]
        cons = spawn([sys.executable, PEERS, "consume", *common, "--warm", str(warm), "--credit", str(a.credit),
                      "--inbox-bytes", str(a.inbox_bytes)])
        prod = spawn([sys.executable, PEERS, "produce", *common, "--mib", str(mib), "--n-samples", str(n + warm),
                      *fresh(a)])
        procs = [cons, prod]
        cpu.watch(cons.pid, prod.pid, threads=True)
        try:
            c, p = result(cons, 600), result(prod, 600)
            rc = b.wait()
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{b.why()}") from None
        if p["sent"] != n + warm:
            raise RuntimeError(f"producer sent {p['sent']} of {n + warm} batches")
    finally:
        cpu.stop()
        b.kill()
        for proc in procs:  # one peer failed: do not leave the other waiting
            if proc.poll() is None:
                proc.kill()
    if rc != 0 or c["received"] != n + warm:
        raise RuntimeError(f"broker exited {rc}, consumer got {c['received']} of {n + warm} batches")
    window = (c["t0"], c["t1"])
    top = {k: cpu.busiest_thread(pid, *window) for k, pid in (("broker", b.proc.pid), ("producer", prod.pid),
                                                              ("consumer", cons.pid))}
    threads = {f"{k}_threads": cpu.busiest_threads(pid, *window) for k, pid in (
        ("broker", b.proc.pid), ("producer", prod.pid), ("consumer", cons.pid))}  # JSON only: where the time went
    return {**c, **threads, **{f"{k}_busiest_thread": t and t[0] for k, t in top.items()},
            "cores": {"producer": cpu.busy(prod.pid, *window), "broker": cpu.busy(b.proc.pid, *window),
                      "consumer": cpu.busy(cons.pid, *window),
                      **{f"{k}_thread": t and t[1] for k, t in top.items()}}}


def fresh(a) -> list[str]:
    return ["--fresh"] if a.fresh_batches else []


def per_gb(cores: float | None, gbps: float) -> float | None:
    """CPU seconds per GB moved: with a core of its own, a process could move 1/this GB/s."""
    return None if cores is None else cores / gbps


def measure(mib: float, modes: list[str], a, runs: Path) -> dict:
    """One run of every mode at one batch size (interleaved, so load changes hit all modes)."""
    nbytes = payload_bytes(batch_tensors(mib))
    n = int(min(a.max_messages, max(8, a.gb * 1e9 / nbytes)))
    warm = max(2, n // 10)
    row = {"mib": mib, "bytes": nbytes, "messages": n, "loadavg": os.getloadavg()[0]}
    if "memcpy" in modes:
        m = memcpy(nbytes)
        row.update(memcpy_warm_gbs=m["warm"], memcpy_fresh_gbs=m["fresh"])
    if "direct" in modes:
        d = direct(mib, n, warm, a)
        row.update(direct_gbs=d["gb_per_s"], direct_msgs=d["msgs_per_s"],
                   **{f"direct_{k}_cpu": per_gb(v, d["gb_per_s"]) for k, v in d["cores"].items()})
    if "broker" in modes:
        for i, io in enumerate(a.broker_io_threads.split(",") if a.broker_io_threads else [""]):
            r = through_broker(mib, n, warm, a, runs, io)
            if i == 0:  # the first setting fills the main columns
                row.update({k: r[k] for k in ("broker_threads", "producer_threads", "consumer_threads")})
                row.update(broker_gbs=r["gb_per_s"], broker_msgs=r["msgs_per_s"], busiest=r["broker_busiest_thread"],
                           busiest_producer=r["producer_busiest_thread"], busiest_consumer=r["consumer_busiest_thread"],
                           **{f"via_{k}_cpu": per_gb(v, r["gb_per_s"]) for k, v in r["cores"].items()})
            if io:
                row.update({f"broker_io{io}_gbs": r["gb_per_s"],
                            f"broker_io{io}_thread_cpu": per_gb(r["cores"]["broker_thread"], r["gb_per_s"])})
                if "direct_gbs" in row:
                    row[f"broker_io{io}_vs_direct"] = r["gb_per_s"] / row["direct_gbs"]
    if "direct_gbs" in row and "broker_gbs" in row:
        row["broker_vs_direct"] = row["broker_gbs"] / row["direct_gbs"]
    return row


def median_row(reps: list[dict]) -> dict:
    """Per-key median over repeated runs (the machine is shared: single runs swing +-50%)."""
    out = dict(reps[0])
    for k, v in reps[0].items():
        if isinstance(v, float):
            vals = sorted(r[k] for r in reps if r.get(k) is not None)
            out[k] = vals[len(vals) // 2] if vals else None
    out["repeats"] = len(reps)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,16,64,256", help="batch sizes in MiB")
    ap.add_argument("--gb", type=float, default=1.5, help="bytes to move per size and mode (GB)")
    ap.add_argument("--max-messages", type=int, default=3000,
                    help="most batches per size and mode (small sizes reach it before --gb)")
    ap.add_argument("--modes", default="memcpy,direct,broker")
    ap.add_argument("--repeat", type=int, default=1, help="runs per size; the table shows medians")
    ap.add_argument("--credit", type=int, default=2,
                    help="consumer inbox floor in batches (ConsumerLink inbox_batches); direct rcvhwm = credit+1")
    ap.add_argument("--inbox-bytes", type=parse_bytes, default="256MiB",
                    help="consumer inbox bound in bytes, as dflash-consume --inbox-bytes (0: exactly --credit batches)")
    ap.add_argument("--io-threads", type=int, default=0, help="ZeroMQ I/O threads of the peers (0: the links' auto)")
    ap.add_argument("--sndhwm", type=int, default=1, help="direct sender's SNDHWM (ProducerLink's: 1)")
    ap.add_argument("--sndbuf", type=int, default=-1, help="SO_SNDBUF of the direct sender (-1: OS default)")
    ap.add_argument("--rcvbuf", type=int, default=-1, help="SO_RCVBUF of the direct receiver")
    ap.add_argument("--queue-bytes", default="1GiB", help="broker --queue-bytes")
    ap.add_argument("--broker-io-threads", default="",
                    help="comma-separated dflash-broker --io-threads values to compare (default: the broker's auto)")
    ap.add_argument("--broker-arg", action="append", default=[], help="extra dflash-broker argument (repeatable)")
    ap.add_argument("--fresh-batches", action="store_true",
                    help="senders copy the batch into new memory for every message, as a producer's batches are "
                         "(default: one buffer sent over and over, from the sender's cache)")
    ap.add_argument("--malloc-reuse", action="store_true", help="spawn every process with common.MALLOC_REUSE")
    ap.add_argument("--label", default="", help="a note stored with the results (what was tuned)")
    ap.add_argument("--out", type=Path, default=RESULTS / "transport.json")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    if a.malloc_reuse:
        common.ENV.update(common.MALLOC_REUSE)
    doc = {"bench": "transport", "machine": machine(), "args": {k: str(v) for k, v in vars(a).items()}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:
        for mib in [float(x) for x in a.sizes.split(",")]:
            reps = [measure(mib, modes, a, Path(tmp) / "runs") for _ in range(a.repeat)]
            doc["runs"] = doc.get("runs", []) + reps
            doc["rows"].append(median_row(reps))
            print(f"{mib:g} MiB done", file=sys.stderr, flush=True)
    doc["machine"]["loadavg_at_end"] = os.getloadavg()
    print(table(doc["rows"], [("mib", "MiB"), ("memcpy_warm_gbs", "memcpy GB/s"), ("memcpy_fresh_gbs", "fresh GB/s"),
                              ("direct_gbs", "direct GB/s"), ("direct_msgs", "msg/s"),
                              ("broker_gbs", "broker GB/s"), ("broker_msgs", "msg/s"),
                              ("broker_vs_direct", "broker/direct")]))
    print()
    print("CPU seconds per GB moved (each process, all threads):")
    print(table(doc["rows"], [("mib", "MiB"), ("direct_send_cpu", "direct send"), ("direct_recv_cpu", "direct recv"),
                              ("via_producer_cpu", "producer"), ("via_broker_cpu", "broker"),
                              ("via_broker_thread_cpu", "broker busiest thread"), ("busiest", "(which)"),
                              ("via_consumer_cpu", "consumer"), ("via_consumer_thread_cpu", "consumer busiest thread"),
                              ("busiest_consumer", "(which)"), ("via_producer_thread_cpu", "producer busiest thread"),
                              ("busiest_producer", "(which)")]))
    if a.broker_io_threads:
        cols = [("mib", "MiB"), ("direct_gbs", "direct GB/s")]
        for io in a.broker_io_threads.split(","):
            cols += [(f"broker_io{io}_gbs", f"broker {io} I/O GB/s"), (f"broker_io{io}_vs_direct", "/direct"),
                     (f"broker_io{io}_thread_cpu", "busiest thread s/GB")]
        print()
        print("Broker by ZeroMQ I/O threads:")
        print(table(doc["rows"], cols))
    write_json(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
