"""Data parallel plumbing: the consumers of a run are ranks of one torch.distributed job.

Gradients are summed, then divided by the global loss weight: exactly single-process training
on the union of the ranks' batches, and a rank without a batch adds zeros, not a skewed mean."""

from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Protocol

import torch
import torch.distributed as dist
from torch import nn

from dflash.protocol.errors import DFlashError


class RankLost(DFlashError):
    """A collective failed: another rank of the group died, left, or never came."""


@contextmanager
def collective_failures_named() -> Iterator[None]:
    """torch.distributed's peer failures as RankLost with a one-line reason; other errors pass."""
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        if not (isinstance(e, dist.DistError) or "Connection closed by peer" in text
                or "Connection reset by peer" in text):
            raise
        raise RankLost(f"the data-parallel group failed: another rank went away or never came "
                       f"({text.splitlines()[0][:200]}); see that rank's log") from e


class DistGroup(Protocol):
    """What the training loop asks of its data-parallel group (`Dist` fixed, elastic.ElasticDist):
    per step `begin_step`, the collectives, `intact`, `commit`."""

    elastic: bool
    rank: int  # this step's rank (elastic: in the quorum)
    world_size: int  # this step's ranks
    device: torch.device

    @property
    def arranged_rank(self) -> int: ...  # the rank the broker arranged (elastic: not the quorum's)
    @property
    def max_world(self) -> int: ...  # the most ranks the group can have (the broker's --consumers)
    @property
    def enabled(self) -> bool: ...  # collectives reach other ranks
    def register_state(self, save: Callable[[], dict], load: Callable[[dict], None]) -> None: ...
    def set_step(self, step: int) -> None: ...
    def begin_step(self) -> None: ...
    def intact(self) -> bool: ...
    def error(self) -> str | None: ...
    def commit(self) -> bool: ...
    def all_sum(self, values: list[float]) -> list[float]: ...
    def sum_grads(self, params: Iterable[nn.Parameter]) -> None: ...
    def broadcast_params(self, module: nn.Module) -> None: ...
    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...
    def gather_rows(self, rows: torch.Tensor, n_max: int) -> torch.Tensor: ...
    def broadcast_str(self, text: str, max_bytes: int = 256) -> str: ...
    def barrier(self) -> None: ...
    def close(self) -> None: ...


class Dist:
    """A fixed group (a DistGroup): every rank for the whole job; a lost rank ends it (RankLost)."""

    elastic = False

    def __init__(self, rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu"):
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)

    # ------------------------------------------------------------ a step (no-ops: a fixed
    # group has no quorum to meet, and a failed collective raises RankLost)

    def register_state(self, save, load) -> None:
        """Only an elastic group hands state to a joining rank."""

    def set_step(self, step: int) -> None:
        """Only an elastic group compares steps (who is behind and heals)."""

    def begin_step(self) -> None:
        """Only an elastic group meets (a quorum) before each step."""

    def intact(self) -> bool:
        return True

    def error(self) -> str | None:
        return None

    def commit(self) -> bool:
        return True

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def arranged_rank(self) -> int:
        return self.rank

    @property
    def max_world(self) -> int:
        return self.world_size

    @classmethod
    def init(
        cls, *, init_method: str, rank: int, world_size: int, device: torch.device | str, timeout_s: float = 600
    ) -> "Dist":
        """Join the job (gloo on CPU, NCCL on GPU); a missing peer raises after `timeout_s`."""
        device = torch.device(device)
        if world_size > 1:
            dist.init_process_group(
                backend="nccl" if device.type == "cuda" else "gloo",
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
                **({"device_id": device} if device.type == "cuda" else {}),
            )
        return cls(rank, world_size, device)

    @classmethod
    def from_torchrun(cls, device: torch.device | str) -> "Dist | None":
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "29500")
        return cls.init(init_method=f"tcp://{addr}:{port}", rank=int(os.environ["RANK"]),
                        world_size=int(os.environ["WORLD_SIZE"]), device=device)

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------ collectives

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks of a short list of numbers (float64)."""
        if not self.enabled:  # nothing to sum: no tensor (on a GPU, a copy there and a read back)
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.enabled:
            dist.all_reduce(t)
        return t.tolist()

    def sum_grads(self, params: Iterable[nn.Parameter]) -> None:
        """Sum every gradient over ranks; a missing one adds zeros, so every rank issues the same collectives."""
        params = list(params)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if not self.enabled:
            return
        works = [dist.all_reduce(p.grad, async_op=True) for p in params]
        for w in works:
            w.wait()

    def broadcast_params(self, module: nn.Module) -> None:
        """Rank 0's weights everywhere, so ranks start (and stay) bit-identical."""
        if self.enabled:
            for t in module.state_dict().values():
                dist.broadcast(t, src=0)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of a same-shaped tensor, on CPU (no pickle, unlike *_object)."""
        if not self.enabled:
            return [t.cpu()]
        t = t.to(self.device)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t)
        return [o.cpu() for o in out]

    def gather_rows(self, rows: torch.Tensor, n_max: int) -> torch.Tensor:
        """Every rank's int64 rows in rank order: one all_gather padded to the caller's known n_max."""
        if not self.enabled:
            return rows
        w = rows.shape[1]
        buf = torch.full((max(1, n_max), w), -1, dtype=torch.int64)
        buf[: rows.shape[0]] = rows
        out = torch.cat(self.all_gather(buf))
        return out[out[:, 0] >= 0]

    def broadcast_str(self, text: str, max_bytes: int = 256) -> str:
        """Rank 0's string on every rank (e.g. the run ID of a local data-parallel run)."""
        if not self.enabled:
            return text
        buf = torch.zeros(max_bytes, dtype=torch.uint8, device=self.device)
        raw = text.encode()[:max_bytes]
        buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        dist.broadcast(buf, src=0)
        return bytes(buf.cpu().tolist()).rstrip(b"\0").decode()

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()
