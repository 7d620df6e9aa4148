"""The core's part for batches between intake and training (PROTOCOL.md 4.5): dispatch by credit,
acks, a lost consumer's batches requeued, and quarantine; dispatch.py keeps the queue and the rule.
"""

from __future__ import annotations

from dflash.runtime.logs import get_logger

from .actions import Outbox, Relay
from .config import MAX_CREDIT
from .dispatch import BatchQueue, Queued, Round, wants_batch
from .ledger import Ledger
from .liveness import RateMeter, TimeShare
from .peers import ConsumerHeld, ConsumerSession
from .quarantine import Poison
from .replies import MAX_REASON, Replies, clip
from .work import Work

log = get_logger()


class Delivery:
    def __init__(self, queue_bytes: int, ledger: Ledger, work: Work, poison: Poison, replies: Replies, out: Outbox,
                 now: float):
        self.queue = BatchQueue(queue_bytes)
        self.ledger, self.work, self.poison, self.replies, self.out = ledger, work, poison, replies, out
        self.batch_ids: set[str] = set()  # queued or in flight: a batch_id is unique in the run
        self.rate_in, self.rate_out = RateMeter(), RateMeter()
        self.full_share = TimeShare(now)  # how much of the last 10 s producers were blocked
        self.blocked = False  # a batch waits on a consumer pipe that is not connected yet
        self.round: Round | None = None  # the round of dispatch under way, and its pick in hand
        self.pick: tuple[Relay, ConsumerSession, Queued] | None = None

    def push(self, q: Queued, now: float) -> None:
        """A batch accepted at intake joins the queue."""
        self.queue.push(q)
        self.batch_ids.add(q.batch_id)
        self.ledger.produced(q)
        self.rate_in.add(1, now)

    def credit(self, c: ConsumerSession, n: int) -> None:
        c.credit = min(MAX_CREDIT, c.credit + n)

    def dispatch(self, consumers: list[ConsumerSession], now: float, draining: bool) -> Relay | None:
        """Start a round of dispatch: the first batch to relay, or None (always while `draining`)."""
        self.pick = None
        if draining:
            self.round, self.blocked = None, False
            return None
        self.round = Round(self.queue, consumers)
        return self.next_pick(now)

    def relayed(self, relay: Relay, port: int | None, now: float) -> Relay | None:
        """The port that took `relay` (None: that consumer sits the round out); returns the next, or None."""
        if self.pick is None or self.pick[0] is not relay:
            raise ValueError(f"{relay} is not the batch this round picked")
        _, c, q = self.pick
        if port is None:
            self.round.refused(c)
        else:
            self.round.took(c, now)
            c.pipes.took(port)
            self.ledger.delivered(q, c.id)
            c.delivered += 1
            c.rate_in.add(1, now)
            c.rate_tokens.add(q.batch.tokens, now)
            self.rate_out.add(1, now)
        return self.next_pick(now)

    def next_pick(self, now: float) -> Relay | None:
        """The round's next batch to relay; at its end (None) what the status map shows of it."""
        pick = self.round.offer()
        if pick is not None:
            c, q = pick
            self.pick = (Relay(c.id, q.batch_id, c.pipes.in_turn()), c, q)
            return self.pick[0]
        queue, consumers = self.queue, self.round.consumers
        self.round = self.pick = None
        self.blocked = bool(queue) and any(wants_batch(c) for c in consumers)
        for c in consumers:  # how long a consumer has had credit and no batch
            hungry = c.credit > 0 and not queue
            c.waiting_since = (c.waiting_since or now) if hungry else None
            c.wait_share.update(hungry, now)
        self.full_share.update(not queue.has_room(), now)
        return None

    def acked(self, c: ConsumerSession, batch_ids: list, step: int, now: float) -> list[Queued]:
        """The batches of `batch_ids` that `c` held, let go; an ID it does not hold is logged."""
        unknown, trained = [], []
        for bid in batch_ids:
            q = c.in_flight.pop(bid, None) if isinstance(bid, str) else None
            if q is None:
                unknown.append(bid)
                continue
            self.batch_ids.discard(bid)
            self.queue.release(q)
            c.acked += 1
            trained.append(q)
        self.out.drop_frames([q.batch_id for q in trained])  # never sent again (a rewind makes its samples anew)
        if trained:
            if c.acked > len(trained):  # a gap between two acks: how slow this consumer's steps are
                c.slowest_ack_gap = max(c.slowest_ack_gap, now - c.progress_at)
            c.progress_at = now
        if unknown and self.replies.allow(f"ack:{c.id}", now)[0]:
            log.warning("broker.ack_unknown", peer=c.id, step=step, batch_ids=[str(x)[:64] for x in unknown[:16]],
                        n=len(unknown))
        return trained

    def take_back(self, c: ConsumerSession) -> ConsumerHeld:
        """A consumer's session ended: what it held goes back to the front of the queue."""
        back = list(c.in_flight.values())
        c.in_flight.clear()
        for q in back:
            self.ledger.requeued(q)
        self.queue.requeue(back)  # returned batches are the oldest: they go first
        return ConsumerHeld(len(back), [x.batch_id for x in back[:16]], c.credit, c.delivered, c.acked, c.rank)

    def failed_on(self, c: ConsumerSession, batch_id: str, fault: str, reason: str) -> dict:
        """`c` cannot train `batch_id`: count it against the batch, quarantined after --quarantine-after
        consumers. Returns the log line's fields."""
        q = c.in_flight.get(batch_id)
        if q is None:  # not delivered to this consumer, or acked: nothing to count against
            return {"batch_held": False}
        if c.id not in q.failures:  # one session counts once, however often it says so
            q.failures.append(c.id)
        n = len(q.failures)
        if n >= self.poison.quarantine_after:
            self.quarantine(c, q, fault, reason)
        return {"batch_held": True, "batch_failures": n, "quarantined": n >= self.poison.quarantine_after}

    def quarantine(self, c: ConsumerSession, q: Queued, fault: str, reason: str) -> None:
        """Take `q` out of `c`'s hands for good; its samples are made again or set aside."""
        del c.in_flight[q.batch_id]
        self.batch_ids.discard(q.batch_id)
        self.queue.release(q)
        self.out.drop_frames([q.batch_id])  # never delivered again
        fault, reason = clip(fault, 64) or "unknown", clip(reason, MAX_REASON)
        b = q.batch
        remade, aside = self.poison.split(b.epoch, b.samples)
        self.ledger.quarantined(q, remade, aside, fault, reason)
        if remade:
            self.work.remake(b.epoch, remade)
        self.poison.count("quarantined", fault, len(b.samples), len(remade), len(aside))
        log.warning("broker.batch_quarantined", batch_id=b.batch_id, producer=b.producer, lease=b.lease,
                    epoch=b.epoch, samples=len(b.samples), remade=len(remade), set_aside=len(aside), fault=fault,
                    reason=reason, consumers=list(q.failures), deliveries=q.deliveries)

    def in_flight(self, consumers: list[ConsumerSession]) -> tuple[int, int]:
        """(batches, bytes) delivered to `consumers` and not acked yet."""
        return (sum(len(c.in_flight) for c in consumers),
                sum(q.nbytes for c in consumers for q in c.in_flight.values()))
