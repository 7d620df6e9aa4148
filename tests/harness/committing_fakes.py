"""The broker tests' wire fakes (tests/harness/fakes.py) as processes, plus what the
reliability tests need of them: a consumer that commits every N steps (so a run killed
mid-way has committed, trained-not-committed and in-flight samples at once), and CurveZMQ
keys for every socket (set as context defaults, so the fakes' own code stays as written
from PROTOCOL.md).

    python -m tests.harness.committing_fakes consumer --broker ... --runs-dir R --commit-every 5
    python -m tests.harness.committing_fakes producer --broker ... --curve-keys K --curve-name p0

Exit codes as fakes.py: 0 after stop / grant end, 3 rejected, 4 broker silent.
"""

from __future__ import annotations

import sys
from pathlib import Path

import zmq
import zmq.auth

from .fakes import FakeConsumer, FakeProducer, fake_parser, serve


class CommittingConsumer(FakeConsumer):
    """Commits every `commit_every` steps, as rank 0 does after each checkpoint."""

    def __init__(self, *a, commit_every: int = 0, **kw):
        super().__init__(*a, **kw)
        self.commit_every = commit_every

    def send(self, type_: str, **fields) -> None:
        super().send(type_, **fields)
        if type_ == "ack" and self.commit_every and fields["step"] % self.commit_every == 0:
            super().send("commit", step=fields["step"], checkpoint=f"fake/step-{fields['step']}")
            self.log("fake.committed", step=fields["step"])


def use_curve(keys_dir: str, name: str) -> None:
    """Every socket this process makes from now on is a CURVE client of the broker."""
    keys = Path(keys_dir)
    server_pub, _ = zmq.auth.load_certificate(keys / "broker.key")
    pub, sec = zmq.auth.load_certificate(keys / f"{name}.key_secret")
    ctx = zmq.Context.instance()
    ctx.setsockopt(zmq.CURVE_SERVERKEY, server_pub)
    ctx.setsockopt(zmq.CURVE_PUBLICKEY, pub)
    ctx.setsockopt(zmq.CURVE_SECRETKEY, sec)


def _peer(a, instance: str, log):
    if a.role == "producer":
        return FakeProducer(a.broker, instance, n_samples=a.n_samples, per_batch=a.per_batch, delay_s=a.delay_s,
                            log=log.info)
    return CommittingConsumer(a.broker, instance, train_s=a.train_s, prefetch=a.prefetch, log=log.info,
                              commit_every=a.commit_every)


def main(argv=None) -> int:
    ap = fake_parser()
    ap.add_argument("--commit-every", type=int, default=0)
    ap.add_argument("--curve-keys", default=None)
    ap.add_argument("--curve-name", default=None)
    a = ap.parse_args(argv)
    if a.curve_keys:
        use_curve(a.curve_keys, a.curve_name)
    return serve(a, _peer)


if __name__ == "__main__":
    sys.exit(main())
