"""One producer spread over several processes (`--tensor-parallel`, launched by torchrun):
the target is sharded by transformers' tensor parallelism, so a target larger than one GPU fits.

Rank 0 is the producer and broadcasts every forward pass to the followers first. Followers
ignore SIGINT/SIGTERM: rank 0 finishes its batch, then stops them, so no collective is left
half-joined."""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from dflash.runtime.logs import get_logger

log = get_logger()

_STOP, _CAPTURE, _ATTN = 0, 1, 2


class ShardError(ValueError):
    """--tensor-parallel cannot run here (reason in the message)."""


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    backend: str

    @property
    def leader(self) -> bool:
        return self.rank == 0


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun sets them. Raises ShardError outside torchrun."""
    try:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError):
        raise ShardError("--tensor-parallel needs a torchrun launch (RANK, WORLD_SIZE, MASTER_ADDR set), e.g. "
                         "torchrun --nproc-per-node 2 -m dflash.producers.produce_command --tensor-parallel ...") from None
    if size < 2:
        raise ShardError(f"--tensor-parallel with WORLD_SIZE {size}: launch 2 or more processes "
                         "(torchrun --nproc-per-node N)")
    return rank, size, local


def init(device: torch.device, timeout_s: float = 24 * 3600.0) -> World:
    """Join this torchrun launch's process group; the long timeout is a follower's wait for rank 0,
    which may wait long for a lease or queue room (docs/SHARDING.md)."""
    rank, size, local = world_from_env()
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    mesh = acc.type if acc is not None else "cpu"
    if mesh != device.type:  # transformers builds its device mesh on the machine's accelerator, whatever we ask
        raise ShardError(f"--tensor-parallel on {device.type}: transformers shards onto this machine's {mesh} "
                         f"devices; run it on {mesh} (or where torch sees no {mesh}, for {device.type})")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return World(rank, size, local, backend)


def rank_device(world: World, device: torch.device) -> torch.device:
    """cuda:LOCAL_RANK for CUDA (one GPU per process), else `device`."""
    if device.type != "cuda":
        return device
    if torch.cuda.device_count() <= world.local_rank:
        raise ShardError(f"rank {world.rank} (local rank {world.local_rank}) has no GPU: torch sees "
                         f"{torch.cuda.device_count()} (launch at most that many processes per node)")
    torch.cuda.set_device(world.local_rank)
    return torch.device("cuda", world.local_rank)


class Leader:
    """Rank 0's side: tells the followers what to run before running it itself."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stopped = False

    def _header(self, op: int, n: int = 0) -> None:
        dist.broadcast(torch.tensor([op, n], dtype=torch.long, device=self.device), src=0)

    def capture(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> None:
        self._header(_CAPTURE, input_ids.numel())
        dist.broadcast(input_ids.to(self.device, torch.long).contiguous(), src=0)
        dist.broadcast(position_ids.to(self.device, torch.long).contiguous(), src=0)

    def set_attn(self, name: str) -> None:
        self._header(_ATTN)
        dist.broadcast_object_list([name], src=0, device=self.device)

    def stop(self) -> None:
        """Release the followers (once; every exit path of rank 0 calls it)."""
        if not self.stopped:
            self.stopped = True
            self._header(_STOP)


def follow(target) -> int:
    """Run what rank 0 broadcasts until it says stop; a failed pass fails on rank 0 too, which decides."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    device, passes = target.device, 0
    header = torch.empty(2, dtype=torch.long, device=device)
    while True:
        dist.broadcast(header, src=0)
        op, n = int(header[0]), int(header[1])
        if op == _STOP:
            return passes
        if op == _ATTN:
            box = [None]
            dist.broadcast_object_list(box, src=0, device=device)
            target.set_attn(box[0])
            continue
        ids = torch.empty(n, dtype=torch.long, device=device)
        pos = torch.empty(n, dtype=torch.long, device=device)
        dist.broadcast(ids, src=0)
        dist.broadcast(pos, src=0)
        passes += 1
        try:
            with target.lock:
                target._capture(ids, pos)
        except Exception as e:  # noqa: BLE001  (rank 0 met the same failure and decides)
            log.warning("produce.follower_pass_failed", rank=dist.get_rank(),
                        error=f"{type(e).__name__}: {str(e)[:300]}")


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def run_then_exit(life: Callable[[], None]) -> NoReturn:
    """Run this rank's life, then os._exit: a gloo worker still releasing the last collective's
    tensors at interpreter shutdown aborts the process, and torchrun would call the run failed."""
    code = 0
    try:
        life()
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001  (printed as the interpreter would, then the same exit path)
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
