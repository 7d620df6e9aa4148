"""bench/recipe_sweep.py takes TrainConfig fields as config keys, the loss and the draft init among
them, and a whole sweep of ce against dpace runs on CPU on a tiny target (its smoke mode, --device cpu)."""

import json
import sqlite3

import click
import numpy as np
import pytest
from click.testing import CliRunner

from tests.harness.bench_script import load
from tests.harness.tiny import MASK_ID
from dflash.consumers.training.train_config import resolve_signal
from dflash.consumers.training.config import TrainConfig

pytestmark = pytest.mark.unit

def _sweep():
    return load("recipe_sweep")


def test_the_loss_is_a_config_key(heads):
    sweep = _sweep()
    c = sweep.parse_config("loss=dpace,dpace_alpha=0.3,lr=2e-3,budget=4096")
    assert c == {"loss": "dpace", "dpace_alpha": 0.3, "lr": 2e-3, "budget": 4096}
    kw = {k: v for k, v in c.items() if k not in sweep._PACKING}
    signal = resolve_signal(TrainConfig(target_layers=(1, 2), mask_token_id=MASK_ID, **kw), heads)
    assert (signal.loss, signal.dpace_alpha) == ("dpace", 0.3)
    with pytest.raises(click.BadParameter, match="'los' is not a TrainConfig field"):
        sweep.parse_config("los=dpace")


def test_the_draft_init_is_a_config_key(heads):
    from structlog.testing import capture_logs

    from dflash.consumers.parallel.dist import Dist
    from dflash.consumers.training.train import Trainer
    from dflash.consumers.training.train_config import Hooks

    c = _sweep().parse_config("draft_init=last,draft_layers=2")
    assert c == {"draft_init": "last", "draft_layers": 2}
    with capture_logs() as logs:
        Trainer(TrainConfig(target_layers=(1, 2), mask_token_id=MASK_ID, **c), heads, Dist(), Hooks(), None, None)
    assert [e["target_layers"] for e in logs if e["event"] == "train.draft_init"] == [[2, 3]]


@pytest.mark.timeout(300)
def test_a_sweep_of_ce_against_dpace_runs_on_cpu(tmp_path):
    from dflash.producers.chat import ChatEncoder
    from dflash.producers.data import Row
    from dflash.producers.sample_data import generate_chats
    from dflash.runtime.targets import load_tokenizer
    from dflash.tools.tiny import tiny_target

    folder = tiny_target(family="qwen3", layers=4)
    enc = ChatEncoder(load_tokenizer(folder), max_length=128)
    chats = generate_chats(40)
    rows = [enc.encode(Row(i, "chats", messages=c["messages"])) for i, c in enumerate(chats)]
    db = sqlite3.connect(tmp_path / "regen.sqlite")  # the producer's regeneration cache (producers/regenerate.py)
    db.execute("CREATE TABLE regen_ids (sample INTEGER PRIMARY KEY, input_ids BLOB NOT NULL, loss_mask BLOB NOT NULL, "
               "messages TEXT)")
    db.executemany("INSERT INTO regen_ids VALUES (?, ?, ?, ?)",
                   [(r.sample, np.asarray(r.input_ids, dtype=np.int32).tobytes(), bytes(r.loss_mask), "[]")
                    for r in rows])
    db.commit()
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    for name, cs in (("indist", chats[:2]), ("heldout", chats[2:4])):
        (prompts / f"{name}.jsonl").write_text("".join(json.dumps({"messages": c["messages"][:1]}) + "\n"
                                                       for c in cs))
    out = tmp_path / "out" / "sweep.json"
    common = "draft_layers=1,block_size=4,anchors=16"
    r = CliRunner().invoke(_sweep().main, [
        "--target", str(folder), "--regen", str(tmp_path / "regen.sqlite"), "--prompts", str(prompts),
        "--samples", "32", "--val", "8", "--eval-prompts", "2", "--max-new-tokens", "8", "--device", "cpu",
        "--config", f"loss=ce,{common}", "--config", f"loss=dpace,dpace_alpha=0.3,{common}", "--out", str(out)])
    assert r.exit_code == 0, r.output
    results = json.loads(out.read_text())["results"]
    assert [x["config"].split(",")[0] for x in results] == ["loss=ce", "loss=dpace"]
    assert all(x["steps"] > 0 and x["sim"]["tau"] >= 1.0 for x in results)
    signals = [json.loads(next((out.parent / f"sweep-ckpt-{i}").glob("step-*/state.json")).read_text())["signal"]
               for i in range(2)]
    assert [(s["loss"], s["dpace_alpha"]) for s in signals] == [("ce", None), ("dpace", 0.3)]
