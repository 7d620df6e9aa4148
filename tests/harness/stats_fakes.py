"""Wire fakes (tests/harness/fakes.py) that also report what real peers put in their
heartbeats (producers/producer.py `stats`, consumers' Hooks.stats) and log what a real
consumer logs (`train.step`), so `dflash-status` can be tested against a live broker
with real sockets while the real consumer CLI is being wired. GPU figures are given
numbers: these machines have no GPU.

    python -m tests.harness.stats_fakes consumer --broker tcp://... --runs-dir R --train-s 0.5
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque

from .fakes import FakeConsumer, FakeProducer, fake_parser, serve

TOKENS_PER_BATCH = 8  # fakes.batch_frames: seq_len 4 x per_batch 2
GiB = 1 << 30


class Window:
    """Tokens per second over the last few seconds, like the real peers measure."""

    def __init__(self, span_s: float = 5.0):
        self.span, self.marks = span_s, deque()

    def add(self, n: int) -> None:
        self.marks.append((time.monotonic(), n))

    def rate(self) -> float:
        now = time.monotonic()
        while self.marks and now - self.marks[0][0] > self.span:
            self.marks.popleft()
        if len(self.marks) < 2:
            return 0.0
        return sum(n for _, n in list(self.marks)[1:]) / max(now - self.marks[0][0], 1e-3)


def gpu_stats(util: float, used_gib: float) -> dict:
    return {"gpu_mem_used": int(used_gib * GiB), "gpu_mem_total": 96 * GiB, "gpu_util": util}


class StatsProducer(FakeProducer):
    def __init__(self, *a, gpu_util: float = 90.0, oom_backoff: bool = False, **kw):
        self.window, self.gpu_util, self.oom_backoff = Window(), gpu_util, oom_backoff
        super().__init__(*a, **kw)

    def push(self, frames: list) -> None:
        super().push(frames)
        self.window.add(TOKENS_PER_BATCH)

    def stats(self) -> dict:
        sent = len(getattr(self, "sent", []))
        return {"state": "producing", "q_pre": 2, "tokens_per_s": round(self.window.rate(), 1),
                "batches_per_s": round(self.window.rate() / TOKENS_PER_BATCH, 3), "oom_backoff": self.oom_backoff,
                "batches": sent, "tokens": sent * TOKENS_PER_BATCH, "samples": 2 * sent, "skipped": 0,
                "bad_rows": 0, "ooms": 1 if self.oom_backoff else 0, **gpu_stats(self.gpu_util, 61.5)}


class StatsConsumer(FakeConsumer):
    """Logs `train.step` per ack, commits every `commit_every` steps, and with
    `oom_at_step` logs a `train.oom` error and dies there (no bye), like an OOM-killed drafter."""

    def __init__(self, *a, gpu_util: float = 95.0, commit_every: int = 5, oom_at_step: int = 0, logger=None, **kw):
        self.window, self.gpu_util = Window(), gpu_util
        self.commit_every, self.oom_at_step, self.logger = commit_every, oom_at_step, logger
        super().__init__(*a, **kw)

    def loss(self) -> float:
        return round(6.0 / (1 + 0.05 * self.step), 4)

    def stats(self) -> dict:
        return {"step": self.step, "state": "training", "loss": self.loss(),
                "acc": round(min(0.9, 0.01 * self.step), 4),
                "streak": round(min(8.0, 0.1 * self.step), 3), "tokens_per_s": round(self.window.rate(), 1),
                "batches_per_s": round(self.window.rate() / TOKENS_PER_BATCH, 3), "prefetched": 0,
                **gpu_stats(self.gpu_util, 70.25)}

    def send(self, type_: str, **fields) -> None:
        super().send(type_, **fields)
        if type_ == "ack":
            self.window.add(TOKENS_PER_BATCH * len(fields["batch_ids"]))
            self._after_step(fields["step"])

    def _after_step(self, step: int) -> None:
        if self.logger is not None:
            self.logger.info("train.step", step=step, loss=self.loss(), acc=self.stats()["acc"],
                             streak=self.stats()["streak"], lr=1e-4, noise=0.0,
                             tokens_per_s=self.stats()["tokens_per_s"], batches_per_s=self.stats()["batches_per_s"],
                             queue={}, epoch=None, eta_s=None, rank=0)
        if self.oom_at_step and step >= self.oom_at_step:
            if self.logger is not None:
                self.logger.error("train.oom", device="cuda:0", step=step, tokens=TOKENS_PER_BATCH,
                                  error="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.74 GiB")
            from dflash.runtime.logs import close_logging

            close_logging()
            os._exit(1)  # dies on the spot: no bye, the broker must notice the silence
        if self.commit_every and step % self.commit_every == 0:
            super().send("commit", step=step, checkpoint=f"fake/step-{step}")


def _peer(a, instance: str, log):
    if a.role == "producer":
        return StatsProducer(a.broker, instance, n_samples=a.n_samples, delay_s=a.delay_s, gpu=a.gpu,
                             gpu_util=a.gpu_util, oom_backoff=a.oom_backoff)
    return StatsConsumer(a.broker, instance, train_s=a.train_s, prefetch=a.prefetch, gpu=a.gpu,
                         gpu_util=a.gpu_util, commit_every=a.commit_every, oom_at_step=a.oom_at_step, logger=log)


def main(argv=None) -> int:
    ap = fake_parser(n_samples=5000)
    ap.add_argument("--gpu-util", type=float, default=90.0)
    ap.add_argument("--oom-backoff", action="store_true")
    ap.add_argument("--commit-every", type=int, default=5)
    ap.add_argument("--oom-at-step", type=int, default=0)
    return serve(ap.parse_args(argv), _peer)


if __name__ == "__main__":
    sys.exit(main())
