"""One data-parallel consumer rank, run as its own process by test_drafter_dp.py.

usage: python -m tests.consumers.dp_worker TARGET_DIR OUT_DIR RANK WORLD_SIZE PORT
Trains on this rank's batches (dp_batches) over a real gloo TCP rendezvous and writes
its flattened parameters and gradients after every step to OUT_DIR/rank<R>.safetensors.
"""

import sys

import torch
from safetensors.torch import save_file
from structlog.testing import capture_logs

from tests.consumers.dp_common import CFG, rank_batches
from dflash.consumers.parallel.dist import Dist
from dflash.runtime.target_heads import load_target_heads
from dflash.consumers.training.train import train
from dflash.consumers.training.train_config import Hooks


def main(target_dir: str, out_dir: str, rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    heads = load_target_heads(target_dir, dtype=torch.float32)
    dist = Dist.init(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device="cpu", timeout_s=60)
    snapshots: dict[str, torch.Tensor] = {}

    def after_step(step, model):
        # .grad still holds the step's averaged, clipped gradient (zeroed next step).
        snapshots[f"step{step}"] = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
        snapshots[f"grad{step}"] = torch.cat([p.grad.flatten() for p in model.parameters()]).clone()

    try:
        with capture_logs():
            state = train(CFG, heads, rank_batches(heads.spec, rank), dist=dist, hooks=Hooks(after_step=after_step))
    finally:
        dist.close()
    snapshots["tokens"] = torch.tensor([state.tokens])
    snapshots["record0"] = torch.from_numpy(state.record.counts(0).copy())  # epoch 0: times each sample was trained
    save_file(snapshots, f"{out_dir}/rank{rank}.safetensors")


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), int(a[3]), int(a[4]))
