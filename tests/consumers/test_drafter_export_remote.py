"""A dflash-export folder is self-contained (issue 20): `dflash.py` beside the weights makes
`AutoModel.from_pretrained(dir, trust_remote_code=True)` work with transformers alone, and
that model's forward (one shot, or block by block with a KV cache as the reference decodes)
equals our drafter's on the same inputs; README.md is a model card from the checkpoint."""

import ast
import json
import stat

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from structlog.testing import capture_logs

from tests.harness.tiny import MASK_ID, rule_batch
from dflash.consumers.export import hf_dflash
from dflash.consumers.drafter.blocks import build_layout
from dflash.consumers.export.export import export_checkpoint, load_exported
from dflash.consumers.export.export_command import main
from dflash.consumers.training.train import train
from dflash.consumers.training.config import TrainConfig

pytestmark = pytest.mark.unit

LAYERS = [1, 2]
B = 4


@pytest.fixture(scope="module")
def checkpoint(heads, tmp_path_factory):
    """A real checkpoint of the training loop (weights and norms moved off their init)."""
    cfg = TrainConfig(draft_layers=2, target_layers=tuple(LAYERS), block_size=B, anchors=6,
                      mask_token_id=MASK_ID, lr=2e-2, log_position_every=0, save_every=0)
    root = tmp_path_factory.mktemp("run") / "checkpoints"
    with capture_logs():
        state = train(cfg, heads, (rule_batch(heads.spec, LAYERS, seed=i) for i in range(4)), ckpt_root=root)
    return state.last_checkpoint


def _ours(drafter, feats, x):
    T = feats.shape[0]
    with torch.no_grad():
        return drafter.model(feats, x, build_layout([T], [torch.tensor([T])], x.shape[0], torch.device("cpu")))


def test_automodel_remote_code_loads_the_export_and_its_forward_equals_ours(checkpoint, heads, tmp_path):
    from transformers import AutoModel, DynamicCache

    out = export_checkpoint(checkpoint, tmp_path / "export")
    remote, info = AutoModel.from_pretrained(out, trust_remote_code=True, dtype=torch.float32,
                                             output_loading_info=True)
    assert type(remote).__name__ == "DFlashDraftModel" and type(remote).__module__.endswith("dflash")
    assert not any(info.values()), info  # every tensor of the file, nothing missing or left over
    remote.eval()
    assert (remote.block_size, remote.mask_token_id, remote.target_layer_ids) == (B, MASK_ID, LAYERS)
    ours = load_exported(out)
    assert next(remote.parameters()).dtype == torch.float32

    g = torch.Generator().manual_seed(0)
    T1, T2, n = 9, 3, len(LAYERS) * heads.spec.hidden_size
    feats = torch.randn(T1 + T2, n, generator=g)
    def block(bonus: int) -> torch.Tensor:  # [B, D]
        return F.embedding(torch.tensor([bonus] + [MASK_ID] * (B - 1)), heads.embed)

    x1, x2 = block(7), block(11)

    # One shot: context 0..T-1, block at T..T+B-1 (as dflash-eval's propose).
    with torch.no_grad():
        got = remote(position_ids=torch.arange(T1 + B)[None], noise_embedding=x1[None], target_hidden=feats[None, :T1])
    torch.testing.assert_close(got[0], _ours(ours, feats[:T1], x1), atol=1e-5, rtol=1e-5)

    # Block by block with a draft KV cache, as the reference's dflash_generate drives it: the
    # second call brings only the new context, the cache was cropped back to the first context.
    cache = DynamicCache()
    with torch.no_grad():
        remote(position_ids=torch.arange(T1 + B)[None], noise_embedding=x1[None], target_hidden=feats[None, :T1],
               past_key_values=cache, use_cache=True)
        cache.crop(-B)  # drop the block, keep the context (a negative crop: transformers 4.x and 5.x alike)
        got = remote(position_ids=torch.arange(T1, T1 + T2 + B)[None], noise_embedding=x2[None],
                     target_hidden=feats[None, T1:], past_key_values=cache, use_cache=True)
    torch.testing.assert_close(got[0], _ours(ours, feats, x2), atol=1e-5, rtol=1e-5)
    # Not vacuous: another context gives other states.
    assert (got[0] - _ours(ours, feats[:T1], x2)).abs().max() > 1e-3

    with pytest.raises(ValueError, match="position_ids"):
        remote(position_ids=torch.arange(T1)[None], noise_embedding=x1[None], target_hidden=feats[None, :T1])


def test_dflash_py_needs_only_torch_and_transformers():
    tree = ast.parse(open(hf_dflash.__file__).read())
    roots = {(a.name if isinstance(n, ast.Import) else n.module).split(".")[0]
             for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert all(not (isinstance(n, ast.ImportFrom) and n.level) for n in ast.walk(tree))  # no relative import
    assert roots == {"__future__", "torch", "transformers"}


def test_export_folder_files_modes_and_model_card(checkpoint, target_dir, tmp_path):
    report = {"tau": 2.5, "tau_pooled": 2.4, "prompts": 6, "new_tokens": 384, "block_size": B, "mismatches": [],
              "speedup": 1.3, "per_prompt": []}
    (tmp_path / "eval.json").write_text(json.dumps(report))
    out = tmp_path / "exp"
    r = CliRunner().invoke(main, [str(checkpoint), str(out), "--target", str(target_dir),
                                  "--eval-report", str(tmp_path / "eval.json")])
    assert r.exit_code == 0, r.output
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "dflash.py", "README.md", "manifest.json"}
    for p in out.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p.name
    assert (out / "dflash.py").read_text() == open(hf_dflash.__file__).read()
    card = (out / "README.md").read_text()
    state = json.loads((checkpoint / "state.json").read_text())
    assert card.startswith("---\nlibrary_name: transformers\n")
    for needle in (str(target_dir), "**2.5**", f"| block size | {B} |", f"| target layers (features) | {LAYERS} |",
                   f"| mask token ID | {MASK_ID} |", f"| optimizer steps | {state['step']} |",
                   f"{state['samples']} / {state['tokens']}", "trust_remote_code=True"):
        assert needle in card, needle
    # Without a report the card says tau was not measured; a file that is no report is refused.
    plain = export_checkpoint(checkpoint, tmp_path / "plain")
    assert "Not measured" in (plain / "README.md").read_text()
    (tmp_path / "bad.json").write_text("{}")
    r = CliRunner().invoke(main, [str(checkpoint), str(tmp_path / "exp3"), "--eval-report", str(tmp_path / "bad.json")])
    assert r.exit_code == 2 and "not a dflash-eval --json report" in r.output
