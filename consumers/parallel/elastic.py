"""Elastic data parallelism through torchft: consumers come and go, the job goes on.

Each consumer is a one-process replica group meeting the others every step at the broker's
lighthouse; a joiner is healed from a healthy replica. Failed collectives do not raise: the step
is dropped on the ranks that saw it (docs/RELIABILITY.md section 8). Gathers are sums of
zero-padded slots: all_reduce is the one managed operation torchft wraps."""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Callable, Iterable

import torch
from torch import nn

from dflash.protocol.errors import DFlashError
from dflash.runtime.logs import get_logger

from .dist import RankLost

log = get_logger()

os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO on stderr


class _TorchftToOurLog(logging.Handler):
    """torchft's warnings and errors as our `consume.torchft` lines (its per-quorum info left out)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level = log.error if record.levelno >= logging.ERROR else log.warning
            level("consume.torchft", logger=record.name, message=record.getMessage()[:2000])
        except Exception:  # a log line must never break a step
            pass


def route_torchft_logs() -> None:
    tf = logging.getLogger("torchft")
    if not any(isinstance(h, _TorchftToOurLog) for h in tf.handlers):
        tf.addHandler(_TorchftToOurLog(logging.WARNING))
        tf.setLevel(logging.WARNING)
        tf.propagate = False


def replica_name(rank: int, instance: str) -> str:
    """The replica ID: quorum ranks follow sorted IDs, so the lowest live broker rank is rank 0."""
    return f"r{rank:05d}-{instance}"


class ElasticDist:
    """An elastic group (a DistGroup, dist.py) through torchft."""

    elastic = True

    def __init__(self, manager, store, pg, device: torch.device, rank: int, max_world: int):
        self._manager, self._store, self._pg = manager, store, pg
        self.device = device
        self.rank, self.world_size = rank, 1  # this step's quorum rank and size (begin_step)
        self.arranged_rank = rank
        self.max_world = max_world
        self.quorums = 0
        self.healed_from: int | None = None  # the step this replica had before its last heal
        self._closed = False
        self._save: Callable[[], dict] | None = None
        self._load: Callable[[dict], None] | None = None

    @property
    def enabled(self) -> bool:
        return True

    @classmethod
    def join(cls, *, lighthouse: str, replica: str, host: str, device: torch.device, rank: int, max_world: int,
             timeout_s: float, quorum_timeout_s: float, connect_timeout_s: float) -> "ElasticDist":
        """Start this replica's TCP store and torchft Manager (heartbeating at once)."""
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        route_torchft_logs()
        timeout = datetime.timedelta(seconds=timeout_s)
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        out = cls(None, store, pg, device, rank, max_world)
        out._manager = Manager(
            pg=pg, load_state_dict=out._heal, state_dict=out._state, min_replica_size=1,
            use_async_quorum=False,  # heal before the step, so a joiner takes part in it
            init_sync=True,  # at step 0 every replica but one heals: one set of weights
            timeout=timeout, quorum_timeout=datetime.timedelta(seconds=quorum_timeout_s),
            connect_timeout=datetime.timedelta(seconds=connect_timeout_s), rank=0, world_size=1, store_addr=host, store_port=store.port,
            lighthouse_addr=lighthouse, replica_id=replica, hostname=host)
        log.info("consume.elastic_join", lighthouse=lighthouse, replica=replica, store=f"{host}:{store.port}",
                 backend="nccl" if device.type == "cuda" else "gloo", max_world_size=max_world)
        return out

    # ------------------------------------------------------------ the training state

    def register_state(self, save: Callable[[], dict], load: Callable[[dict], None]) -> None:
        self._save, self._load = save, load

    def set_step(self, step: int) -> None:
        """Our step (a resumed checkpoint's): the quorum compares steps to decide who heals."""
        self._manager.load_state_dict({"step": step, "batches_committed": self._manager.batches_committed()})

    def _state(self) -> dict:
        assert self._save is not None, "register_state first"
        return self._save()

    def _heal(self, state: dict) -> None:
        assert self._load is not None, "register_state first"
        self._load(state)

    # ------------------------------------------------------------ a step

    def begin_step(self) -> None:
        """The quorum; a replica behind the others is healed here. RankLost if none forms in time."""
        before = (self.rank, self.world_size)
        t0 = time.monotonic()
        try:
            self._manager.start_quorum()
        except DFlashError:  # ours, from the heal (e.g. SignalMismatch): as it is
            raise
        except Exception as e:  # torchft raises its RPC errors as they are
            raise RankLost(f"no elastic quorum: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from e
        self.rank = int(self._manager.participating_rank() or 0)
        self.world_size = int(self._manager.num_participants())
        self.quorums += 1
        if (self.rank, self.world_size) != before or self.quorums == 1:
            log.info("train.quorum", rank=self.rank, world_size=self.world_size, previous_rank=before[0],
                     previous_world_size=before[1], step=self._manager.current_step(),
                     seconds=round(time.monotonic() - t0, 3))

    def intact(self) -> bool:
        return self._manager.errored() is None

    def error(self) -> str | None:
        e = self._manager.errored()  # torchft's ExceptionWithTraceback
        return None if e is None else str(getattr(e, "original_exception", e)).splitlines()[0][:300]

    def commit(self) -> bool:
        """Apply this step? A rank that saw a failure first aborts its process group, so a peer still
        waiting on it in a collective fails at once, not at the timeout."""
        if not self.intact():
            self._pg.abort()
        return bool(self._manager.should_commit())

    # ------------------------------------------------------------ collectives (sums)

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed import ReduceOp

        self._manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()
        return t

    def all_sum(self, values: list[float]) -> list[float]:
        return self._sum(torch.tensor(values, dtype=torch.float64, device=self.device)).tolist()

    def sum_grads(self, params: Iterable[nn.Parameter]) -> None:
        from torch.distributed import ReduceOp

        params = list(params)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        works = [self._manager.allreduce(p.grad, reduce_op=ReduceOp.SUM) for p in params]
        for w in works:
            w.wait()

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's same-shaped tensor (each fills its slot of a zeroed buffer, one sum)."""
        wide = torch.float64 if t.is_floating_point() else torch.int64
        buf = torch.zeros((self.world_size, *t.shape), dtype=wide, device=self.device)
        buf[self.rank] = t.to(self.device, wide)
        self._sum(buf)
        if not self.intact():
            return [t.cpu()]
        return [b.to(t.dtype).cpu() for b in buf]

    def gather_rows(self, rows: torch.Tensor, n_max: int) -> torch.Tensor:
        """Every rank's int64 rows in rank order, shifted by one so the zero padding drops out."""
        w = rows.shape[1]
        buf = torch.zeros((max(1, n_max), w), dtype=torch.int64)
        buf[: rows.shape[0]] = rows + 1
        out = torch.cat(self.all_gather(buf)) - 1
        return out[out[:, 0] >= 0]

    def broadcast_params(self, module: nn.Module) -> None:
        """Nothing to do: the first quorum heals every replica but one from it (init_sync)."""

    def broadcast_str(self, text: str, max_bytes: int = 256) -> str:
        raw = torch.zeros(max_bytes, dtype=torch.uint8)
        data = text.encode()[:max_bytes]
        raw[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        first = self.all_gather(raw)[0]
        return bytes(first.tolist()).rstrip(b"\0").decode()

    def barrier(self) -> None:
        """Nothing to wait for: a rank that fails after this leaves, the others go on."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._manager.shutdown(wait=False)
        except Exception as e:  # shutting down after a failure: say so, do not mask the failure
            log.warning("consume.elastic_shutdown_failed", error=str(e)[:200])

