"""What a drafter training step dispatches, counted on the CPU: every aten op, and the
operations that make the host wait for a GPU's results (a synchronisation), in the
training thread only (the staging thread's host-side work is not the step's).

A GPU waits for the host at: a scalar read (`.item()`, `float(t)`, `bool(t)`:
aten._local_scalar_dense), a result whose size depends on the data (nonzero, boolean-mask
indexing, masked_select, unique, bincount, repeat_interleave without output_size), and a
copy back to the host (`.tolist()`, `.cpu()`, `.numpy()`). On a CPU the same calls are
made, so counting them here counts the syncs the step would make on a GPU. The optimizer
step is left out of both counts: on a GPU the trainer takes the fused AdamW, which keeps
its step counters on the device, on the CPU the foreach one, which reads them back.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file
from structlog.testing import capture_logs
from torch.utils._python_dispatch import TorchDispatchMode

# SmolLM2-135M's shape, narrowed for a CPU: tied embeddings, 9 query heads over 3 K/V heads
SMOL_TINY = {"model_type": "llama", "hidden_size": 72, "intermediate_size": 192, "num_attention_heads": 9,
             "num_key_value_heads": 3, "head_dim": 8, "num_hidden_layers": 30, "vocab_size": 512,
             "rms_norm_eps": 1e-5, "rope_theta": 100000, "max_position_embeddings": 8192,
             "tie_word_embeddings": True}

_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
             "unique_consecutive", "unique_dim", "bincount", "histc"}
_HOST_READS = ("tolist", "cpu", "numpy")


def _is_sync(name: str, func, args, kwargs) -> bool:
    if name in _SYNC_OPS:
        return True
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):  # a boolean mask among the indices
        idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in idx)
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None) and \
            isinstance(args[0], torch.Tensor) and not isinstance(args[1] if len(args) > 1 else None, int)
    return False


class StepOps(TorchDispatchMode):
    """Counts aten ops (`ops`) and sync-forcing calls (`syncs`) of the thread that enters it,
    while `counting` and not paused."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.syncs: Counter = Counter()
        self.counting = False
        self._paused = 0
        self._thread = threading.get_ident()
        self._saved: dict = {}

    def _on(self) -> bool:
        return self.counting and not self._paused and threading.get_ident() == self._thread

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._on():
            name = func._overloadpacket.__name__
            self.ops[name] += 1
            if _is_sync(name, func, args, kwargs):
                self.syncs[name] += 1
        return func(*args, **kwargs)

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def patch_host_reads(self) -> None:
        """Count the Tensor methods that copy to the host (they dispatch nothing on a CPU)."""
        for name in _HOST_READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counted(t, *a, _name=name, _original=original, **k):
                if self._on():
                    self.syncs[_name] += 1
                return _original(t, *a, **k)

            setattr(torch.Tensor, name, counted)

    def unpatch_host_reads(self) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved = {}


def fake_smol_target(folder: Path, cfg: dict = SMOL_TINY) -> Path:
    """config.json and the two head tensors (all a consumer reads of a target)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    V, D = cfg["vocab_size"], cfg["hidden_size"]
    save_file({"model.embed_tokens.weight": torch.randn(V, D, generator=g) * 0.02}, folder / "model.safetensors")
    return folder


def count_training(folder: Path, *, attn: str = "sdpa", warm: int = 2, steps: int = 4, seqs: int = 4,
                   seq_len: int = 64, block_size: int = 8, anchors: int = 16, draft_layers: int = 2,
                   stage_batches: bool = True) -> dict:
    """Train `warm + steps` steps of the real Trainer on the SmolLM2-shaped tiny target, with
    a new sequence length every batch (as bench/drafter_step.py --vary), and count what the
    last `steps` steps dispatch, from the end of one step to the end of the next (the fetch
    of the next batch included). Returns per-step figures and every step's loss."""
    from dflash.consumers.parallel.dist import Dist
    from dflash.consumers.process.synthetic import rule_batch
    from dflash.consumers.training.train import Trainer
    from dflash.consumers.training.train_config import Hooks, resolve_signal
    from dflash.consumers.training.config import TrainConfig
    from dflash.runtime.target_heads import load_target_heads

    heads = load_target_heads(fake_smol_target(folder), dtype=torch.float32)
    cfg = TrainConfig(block_size=block_size, anchors=anchors, attn=attn, loss_chunk=64, lr=1e-3,
                      total_steps=warm + steps, log_position_every=0, mask_token_id=SMOL_TINY["vocab_size"] - 1,
                      draft_layers=draft_layers, stage_batches=stage_batches, seed=5)
    layers = list(resolve_signal(cfg, heads).target_layers)
    batches = [rule_batch(heads.spec, layers, seed=i, n_seqs=seqs, seq_len=seq_len - (7 * i) % (seq_len // 2),
                          sample_start=i * seqs) for i in range(warm + steps)]
    mode = StepOps()

    def after_step(step, _model):
        mode.counting = warm <= step < warm + steps  # from the end of step `warm` to the end of the last

    trainer = Trainer(cfg, heads, Dist(), Hooks(after_step=after_step), None, None)
    step_optimizer = trainer.optimizer.step

    def optimizer_step(*a, **k):
        with mode.paused():
            return step_optimizer(*a, **k)

    trainer.optimizer.step = optimizer_step
    trainer.join_or_resume(None)
    trainer.announce()
    mode.patch_host_reads()
    try:
        with capture_logs() as logs, mode:
            trainer.run(batches)
    finally:
        mode.unpatch_host_reads()
    losses = [e["loss"] for e in logs if e["event"] == "train.step"]
    digest = hashlib.sha256()
    for t in trainer.model.state_dict().values():  # the trained weights, bit for bit
        digest.update(t.detach().contiguous().numpy().tobytes())
    return {"attn": attn, "steps": steps, "ops_per_step": sum(mode.ops.values()) / steps,
            "syncs_per_step": sum(mode.syncs.values()) / steps, "syncs": dict(mode.syncs),
            "top_ops": dict(mode.ops.most_common(12)), "losses": losses, "weights_sha256": digest.hexdigest()[:16]}
