"""Put an earlier run's regenerated answers where a new producer will look for them.

    python bench/seed_regen_cache.py --from OLD.sqlite --target T --data F --regen-cache DIR \
        --max-new-tokens 256 [--gpu 0]

The producer's regeneration cache is one SQLite file per key (producers/regenerate.py
`cache_key`: the data's fingerprint, the target, its dtype and config, the settings). A
file carried from another machine holds the right answers under another key whenever one
of those differs only in form (a re-written but identical prompt file, another
transformers version's config text). This loads the producer's components exactly as
`dflash-produce --regenerate` would with these options, and copies OLD's rows into the
cache file of that key, checking that each row's first user turn equals the data row's.
OLD's answers were made to the cap, without the loop rule (a cache of format ids-v1), so
they go to the key of `--no-regen-loops`, each turn's ending recorded (`eos` or `cap`): run
the producer with `--no-regen-loops` to train on them.
"""

from __future__ import annotations

import json
import sqlite3

import click
import numpy as np


def _question(messages: list[dict]) -> str:
    return next(m["content"] for m in messages if m["role"] == "user")


@click.command()
@click.option("--from", "old", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--target", required=True)
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--regen-cache", required=True, type=click.Path(file_okay=False))
@click.option("--max-new-tokens", required=True, type=int)
@click.option("--gpu", default=None, type=int)
def main(old, target, data, regen_cache, max_new_tokens, gpu) -> None:
    from dflash.producers.build import load_components
    from dflash.producers.producer_config import ProducerConfig

    cfg = ProducerConfig(target=target, data=data, gpu=gpu, device=None if gpu is not None else "cpu",
                         regenerate=True, regen_cache=regen_cache, max_new_tokens=max_new_tokens,
                         check_packing=False, regen_loops=False)
    comps = load_components(cfg)
    path = comps.regenerator.cache.path
    rows = sqlite3.connect(old).execute("SELECT sample, input_ids, loss_mask, messages FROM regen_ids").fetchall()
    data_rows = [json.loads(x) for x in open(data, encoding="utf-8")]
    for sample, _, _, messages in rows:
        if _question(json.loads(messages)) != _question(data_rows[sample]["messages"]):
            raise click.ClickException(f"{old}: sample {sample}'s question is not row {sample} of {data}")
    from dflash.decoding.endings import classify

    stops = comps.regenerator.stop_ids

    def endings(ids: bytes, mask: bytes) -> str:  # each answer (a run of loss 1) by its last token
        ids_, out, start = np.frombuffer(ids, dtype=np.int32).tolist(), [], None
        for i, m in enumerate(list(mask) + [0]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                out.append(classify(ids_[start:i], stops, None)[0])
                start = None
        return ",".join(out)

    db = sqlite3.connect(path)
    db.executemany("INSERT OR REPLACE INTO regen_ids VALUES (?, ?, ?, ?, ?)",
                   [(s, ids, mask, m, endings(ids, mask)) for s, ids, mask, m in rows])
    db.commit()
    click.echo(json.dumps({"cache": str(path), "rows": len(rows), "data_rows": len(data_rows)}))


if __name__ == "__main__":
    main()
