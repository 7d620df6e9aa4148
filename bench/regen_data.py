"""Regenerate a whole data set into the producer's regeneration cache, ahead of a run, and
say how fast: the separate regeneration pass that `dflash-produce --regenerate` then reads.

    python bench/regen_data.py --target T --data F --regen-cache DIR --max-new-tokens 256 --gpu 0

The producer's components are loaded exactly as `dflash-produce --regenerate` loads them
with these options (so the cache file is the one of its key), and every data row goes
through the producer's `Regenerator` in chunks of `--chunk` rows (continuous batching of
`--regen-batch-size` rows inside a chunk). Rows already cached are skipped; `--budget-s`
leaves the rest to the producer. Prints one
JSON line: rows, new tokens, seconds of generation, new tokens/s.
"""

from __future__ import annotations

import json
import time

import click


@click.command()
@click.option("--target", required=True)
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--regen-cache", required=True, type=click.Path(file_okay=False))
@click.option("--max-new-tokens", default=1024, type=int, help="As dflash-produce --max-new-tokens.")
@click.option("--regen-batch-size", default=0, type=int,
              help="As dflash-produce --regen-batch-size (its default, 0: rows by memory).")
@click.option("--chunk", default=4096, type=int, help="Rows handed to the regenerator at once.")
@click.option("--limit", default=None, type=int, help="Only the first N rows.")
@click.option("--budget-s", default=None, type=float, help="Start no chunk after this many seconds (the producer "
              "regenerates the rest when its leases reach them).")
@click.option("--gpu", default=None, type=int)
def main(target, data, regen_cache, max_new_tokens, regen_batch_size, chunk, limit, budget_s, gpu) -> None:
    import sys

    from dflash.producers.build import load_components
    from dflash.producers.producer_config import ProducerConfig
    from dflash.runtime.logs import setup_logging

    setup_logging("tool", "regen_data", gpu=gpu, stream=sys.stderr)  # stdout is the JSON report alone

    cfg = ProducerConfig(target=target, data=data, gpu=gpu, device=None if gpu is not None else "cpu",
                         regenerate=True, regen_cache=regen_cache, max_new_tokens=max_new_tokens,
                         regen_batch_size=regen_batch_size, check_packing=False)
    comps = load_components(cfg)
    regen, ds = comps.regenerator, comps.dataset
    n = len(ds) if limit is None else min(limit, len(ds))
    t0 = time.monotonic()
    tokens = rows = 0
    for lo in range(0, n, chunk):
        if budget_s is not None and time.monotonic() - t0 > budget_s:
            n = lo
            break
        before, before_tokens = regen.generated, regen.new_tokens
        t = time.monotonic()
        batch = [ds.read(i) for i in range(lo, min(n, lo + chunk))]
        regen.apply(batch)
        made = regen.new_tokens - before_tokens
        tokens += made
        rows += regen.generated - before
        click.echo(json.dumps({"rows_done": lo + len(batch), "generated": regen.generated - before,
                               "new_tokens": made, "s": round(time.monotonic() - t, 1)}), err=True)
    s = time.monotonic() - t0
    click.echo(json.dumps({"rows": n, "generated": rows, "cached_before": regen.cache_hits, "new_tokens": tokens,
                           "seconds": round(s, 1), "new_tokens_per_s": round(tokens / s, 1) if s else None,
                           "regen_batch_size": regen_batch_size, "cache": str(regen.cache.path)}))


if __name__ == "__main__":
    main()
