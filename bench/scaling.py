"""Several producers and consumers through one broker on loopback: aggregate GB/s.

    python bench/scaling.py                       # 1x1, 2x2, 4x4 at 16 MiB; ~1.5 min on 2 cores
    python bench/scaling.py --layouts 1x1,1x4,4x1 --mib 64

Every peer is a real client process (protocol/links.py, bench/transport_peers.py)
and the broker a real `dflash-broker`. The aggregate counts the batches all consumers
received while all of them were running (from the last consumer's warm-up to the first
consumer's last batch). Beside it: the cores each kind of process kept busy, and the
broker's busiest thread (ZeroMQ's I/O thread): on a machine with a core for each process
the broker is the limit once that thread approaches one full core, at 1 / (its CPU s per
GB) GB/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import common
from common import RESULTS, Broker, CpuSampler, batch_tensors, machine, payload_bytes, result, spawn, table, \
    write_json
from dflash.protocol.sockets import AUTO_DATA_STREAMS
from dflash.runtime.command_line import parse_bytes

PEERS = str(Path(__file__).resolve().parent / "transport_peers.py")


def run_layout(n_prod: int, n_cons: int, mib: float, gb: float, a, runs: Path) -> dict:
    nbytes = payload_bytes(batch_tensors(mib))
    n = int(max(8 * n_cons, gb * 1e9 / nbytes))
    warm = 2
    b = Broker(runs, n_cons * AUTO_DATA_STREAMS + 1, "--num-samples", str(n), "--lease-size", "16", "--queue-bytes", a.queue_bytes,
               "--heartbeat-s", "1", "--timeout-s", "60", *a.broker_arg)
    cpu = CpuSampler().watch(b.proc.pid, threads=True)
    procs = []
    try:
        base = ["--broker", b.control, "--runs-dir", str(runs)]
        cons = [spawn([sys.executable, PEERS, "consume", *base, "--instance", f"c{i}", "--warm", str(warm),
                       "--credit", str(a.credit), "--inbox-bytes", str(a.inbox_bytes), "--times"])
                for i in range(n_cons)]
        prods = [spawn([sys.executable, PEERS, "produce", *base, "--instance", f"p{i}", "--mib", str(mib),
                        "--n-samples", str(n)]) for i in range(n_prod)]
        procs = cons + prods
        cpu.watch(*(p.pid for p in procs))
        try:
            got = [result(c, 900) for c in cons]
            for p in prods:
                result(p, 900)
            rc = b.wait()
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{b.why()}") from None
    finally:
        cpu.stop()
        b.kill()
        for p in procs:
            if p.poll() is None:
                p.kill()
    if rc != 0 or sum(c["received"] for c in got) != n:
        raise RuntimeError(f"broker exited {rc}; consumers got {[c['received'] for c in got]} of {n}")
    starved = [c for c in got if len(c["times"]) <= warm]
    if starved:
        raise RuntimeError(f"{len(starved)} consumer(s) got at most {warm} batches: use more --gb")
    t0 = max(c["times"][warm] for c in got)
    t1 = min(c["times"][-1] for c in got)
    if t1 <= t0:
        raise RuntimeError("consumers never all ran at once: use more --gb")
    inside = sum(1 for c in got for t in c["times"] if t0 < t <= t1)
    gbps = inside * nbytes / (t1 - t0) / 1e9
    busy = lambda ps: sum(cpu.busy(p.pid, t0, t1) or 0.0 for p in ps)  # noqa: E731
    top = cpu.busiest_thread(b.proc.pid, t0, t1)
    threads: dict[str, float] = {}  # cores per thread name (summed: every Python thread is "python")
    for k in (k for k in cpu.samples if len(k) == 2 and k[0] == b.proc.pid):
        threads[cpu.names[k]] = threads.get(cpu.names[k], 0.0) + (cpu.busy(b.proc.pid, t0, t1, k[1]) or 0.0)
    return {"layout": f"{n_prod}x{n_cons}", "producers": n_prod, "consumers": n_cons, "mib": mib, "batches": n,
            "broker_threads": {k: round(v, 3) for k, v in threads.items() if v > 0.01},
            "window_s": t1 - t0, "gb_per_s": gbps, "msgs_per_s": gbps * 1e9 / nbytes,
            "per_consumer": [len(c["times"]) for c in got],
            "producer_cores": busy(prods), "consumer_cores": busy(cons),
            "broker_cores": cpu.busy(b.proc.pid, t0, t1), "broker_thread": top and top[0],
            "broker_thread_cores": top and top[1],
            "broker_thread_cpu_s_per_gb": top and top[1] / gbps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="1x1,2x2,4x4", help="PRODUCERSxCONSUMERS, comma-separated")
    ap.add_argument("--mib", type=float, default=16, help="batch size (MiB)")
    ap.add_argument("--gb", type=float, default=2.0, help="bytes to move per layout (GB)")
    ap.add_argument("--credit", type=int, default=2, help="each consumer's inbox floor in batches")
    ap.add_argument("--inbox-bytes", type=parse_bytes, default="256MiB",
                    help="each consumer's inbox bound in bytes, as dflash-consume --inbox-bytes (0: --credit batches)")
    ap.add_argument("--queue-bytes", default="1GiB", help="broker --queue-bytes")
    ap.add_argument("--broker-arg", action="append", default=[], help="extra dflash-broker argument (repeatable)")
    ap.add_argument("--malloc-reuse", action="store_true", help="spawn every process with common.MALLOC_REUSE")
    ap.add_argument("--out", type=Path, default=RESULTS / "scaling.json")
    a = ap.parse_args(argv)
    if a.malloc_reuse:
        common.ENV.update(common.MALLOC_REUSE)
    doc = {"bench": "scaling", "machine": machine(), "args": {k: str(v) for k, v in vars(a).items()}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="dflash-scaling-") as tmp:
        for layout in a.layouts.split(","):
            p, c = (int(x) for x in layout.split("x"))
            doc["rows"].append(run_layout(p, c, a.mib, a.gb, a, Path(tmp) / "runs"))
            print(f"{layout} done", file=sys.stderr, flush=True)
    doc["machine"]["loadavg_at_end"] = os.getloadavg()
    print(table(doc["rows"], [("layout", "PxC"), ("mib", "MiB"), ("gb_per_s", "GB/s"), ("msgs_per_s", "batches/s"),
                              ("producer_cores", "producer cores"), ("broker_cores", "broker cores"),
                              ("broker_thread_cores", "broker busiest thread"), ("broker_thread", "(which)"),
                              ("broker_thread_cpu_s_per_gb", "its CPU s/GB"), ("consumer_cores", "consumer cores")]))
    write_json(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
