"""Regeneration speed on CPU, before and after issue 18's producer-side changes, on the
bundled chats (producers/sample_data/chats.jsonl) with a tiny target or a real one.

    python bench/regen_cpu.py --rows 48 --new 32 --batch 32 --lease 4 [--target DIR [--gguf FILE]]

Sections (each its own cache, all greedy, outputs compared):
  per_lease   the producer before the regeneration thread: leases of --lease rows, each
              regenerated when it comes (Regenerator.apply, decoder of that lease's rows);
  ahead       the regeneration thread (producers/regen_ahead.py) over the same order,
              --batch rows decoding continuously, leases asked for in turn;
  prefill     GreedyDecoder over the first turns of the rows with refills 4 rows at a time:
              the padded prefill (`--old-decode`: a decode.py without packed prefills, e.g.
              `git show 4f81c6a:producers/decode.py > /tmp/old_decode.py`) against packed.
Prints one JSON object: new tokens/s and seconds per section, and whether outputs agree.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lease", type=int, default=4)
    ap.add_argument("--target", default=None, help="model folder (default: the tiny target)")
    ap.add_argument("--gguf", default=None, help="GGUF file name inside --target")
    ap.add_argument("--old-decode", default=None, help="a decode.py without packed prefills, for 'prefill'")
    ap.add_argument("--sections", default="per_lease,ahead,prefill")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from transformers import AutoTokenizer

    import dflash.producers.sample_data as sd
    from dflash.producers.data import open_dataset
    from dflash.producers.regen_ahead import RegenAhead
    from dflash.producers.regenerate import RegenCache, Regenerator, stop_ids
    from dflash.producers.target import load_target
    from dflash.tools.tiny import tiny_target

    tmp = Path(tempfile.mkdtemp(prefix="regen-bench-"))
    lines = (Path(sd.__file__).parent / "chats.jsonl").read_text().splitlines()[: a.rows]
    (tmp / "chats.jsonl").write_text("\n".join(lines) + "\n")
    data = open_dataset(tmp / "chats.jsonl")
    folder = a.target or str(tiny_target())
    target_arg = folder if a.gguf is None else str(Path(folder) / a.gguf)
    target = load_target(target_arg, None, device=torch.device("cpu"), full=True)
    tok = AutoTokenizer.from_pretrained(folder, **({"gguf_file": a.gguf} if a.gguf else {}))
    rows = [data.read(i) for i in range(len(data))]
    out: dict = {"rows": len(rows), "new": a.new, "batch": a.batch, "lease": a.lease, "target": Path(target_arg).name,
                 "threads": a.threads}
    results = {}

    def regen(name: str, batch: int) -> Regenerator:
        return Regenerator(target, tok, RegenCache(tmp / name, "k"), max_new_tokens=a.new, batch_size=batch)

    want = set(a.sections.split(","))
    if "per_lease" in want:
        r = regen("per_lease", a.batch)
        t0 = time.monotonic()
        got = []
        for i in range(0, len(rows), a.lease):
            got += r.apply(rows[i:i + a.lease])
        s = time.monotonic() - t0
        toks = sum(sum(g.loss_mask) for g in got)
        out["per_lease"] = {"s": round(s, 2), "new_tokens": toks, "new_tokens_per_s": round(toks / s, 1)}
        results["per_lease"] = [(g.input_ids, g.loss_mask) for g in got]
    if "ahead" in want:
        r = regen("ahead", a.batch)
        t0 = time.monotonic()
        e = RegenAhead(r, data, ahead=len(rows), order=list(range(len(rows))))
        e.start()
        got = {}
        for i in range(0, len(rows), a.lease):  # leases asked for in turn, as the prefetch thread does
            part = rows[i:i + a.lease]
            got.update(e.request(part))
            waiting = {x.sample for x in part} - set(got)
            while waiting:
                ready = e.wait(waiting)
                got.update(ready)
                waiting -= set(ready)
        s = time.monotonic() - t0
        e.stop()
        toks = sum(sum(g.loss_mask) for g in got.values())
        out["ahead"] = {"s": round(s, 2), "new_tokens": toks, "new_tokens_per_s": round(toks / s, 1)}
        results["ahead"] = [(got[i].input_ids, got[i].loss_mask) for i in range(len(rows))]
    if len(results) == 2:
        out["per_lease_equals_ahead"] = results["per_lease"] == results["ahead"]
    if "prefill" in want:
        prompts = [tok(tok.apply_chat_template(x.messages[:1], tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"] for x in rows]
        mods = {"packed": sys.modules["dflash.decoding.greedy"]}
        if a.old_decode:
            spec = importlib.util.spec_from_file_location("old_decode", a.old_decode)
            old = importlib.util.module_from_spec(spec)
            sys.modules["old_decode"] = old  # its dataclasses look their module up
            spec.loader.exec_module(old)
            mods["padded"] = old
        outs = {}
        for name, mod in mods.items():
            dec = mod.GreedyDecoder(target.model, rows=a.batch, max_prompt=max(map(len, prompts)),
                                    max_new_tokens=a.new, stop_ids=stop_ids(target.model, tok), refill_min=4)
            lens = [8 + (7 * i) % a.new for i in range(len(prompts))]  # answers of varied length: refills
            res = {}
            t0 = time.monotonic()
            dec.run(deque(mod.Job(i, p, n) for i, (p, n) in enumerate(zip(prompts, lens))),
                    lambda j, o: res.__setitem__(j.key, o))
            s = time.monotonic() - t0
            toks = sum(len(v) for v in res.values())
            out[f"prefill_{name}"] = {"s": round(s, 2), "new_tokens": toks, "new_tokens_per_s": round(toks / s, 1),
                                      "steps": dec.steps, "prefill_forwards": getattr(dec, "prefills", None)}
            outs[name] = [res[i] for i in range(len(prompts))]
        if len(outs) == 2:
            out["padded_equals_packed"] = outs["padded"] == outs["packed"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
