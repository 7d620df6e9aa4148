"""Run under torchrun (2 processes, CPU, gloo) by test_sharded_producer.py: load the target
at argv[1] sharded (--tensor-parallel's code path), rank 0 captures the packed batch saved
in argv[2] (through the start-up packing check first, as a producer does) and writes its
features and what its shards look like to argv[3]; the other rank follows."""

import sys

import torch

from dflash.producers import shard
from dflash.producers.build import _check_packing
from dflash.producers.target import load_target


def main(folder: str, batch_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    world = shard.init(cpu)
    target = load_target(folder, "0,1,2", device=cpu, dtype="float32", attn_impl="auto", tensor_parallel=True)
    if not world.leader:
        shard.follow(target)
        shard.close()
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
        shard.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
