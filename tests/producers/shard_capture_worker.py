"""Run under torchrun (2 processes, CPU, gloo) by test_sharded_producer.py: for each target
folder in argv[3:], load it sharded (--tensor-parallel's code path); rank 0 runs the
start-up packing check, as a producer does, captures the packed batch saved in argv[1]
and writes its features and what its shards look like to argv[2]/<folder name>.pt; the
other rank follows."""

import sys
from pathlib import Path

import torch

from dflash.producers import shard
from dflash.producers.build import _check_packing
from dflash.producers.target import load_target


def main(batch_file: str, out_dir: str, *folders: str) -> None:
    torch.set_num_threads(1)
    world = shard.init(torch.device("cpu"))
    for folder in folders:
        one(world, folder, batch_file, Path(out_dir) / f"{Path(folder).name}.pt")
    shard.close()


def one(world, folder: str, batch_file: str, out_file: Path) -> None:
    cpu = torch.device("cpu")
    target = load_target(folder, "0,1,2", device=cpu, dtype="float32", attn_impl="auto", tensor_parallel=True)
    if not world.leader:
        shard.follow(target)
        return
    target.shard = shard.Leader(cpu)
    try:
        _check_packing(target, auto_attn=True)
        batch = torch.load(batch_file)
        hidden = target.capture(batch["input_ids"], batch["position_ids"])
        local = {name: tuple(p.to_local().shape) for name, p in target.decoder.named_parameters()
                 if hasattr(p, "to_local")}
        full = {name: tuple(p.shape) for name, p in target.decoder.named_parameters()}
        torch.save({"hidden": hidden.clone(), "local": local, "full": full, "world": world.size,
                    "attn_impl": target.info.attn_impl}, out_file)
    finally:
        target.shard.stop()


if __name__ == "__main__":
    shard.run_then_exit(lambda: main(*sys.argv[1:]))  # as the producer leaves (shard.run_then_exit says why)
