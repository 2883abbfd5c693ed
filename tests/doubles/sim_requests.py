"""S3's partitions of one key range against single requests, each client paced by the real
``AdaptiveLimiter`` and retried by a paced ``S3Store``'s rule, on a virtual clock.

What runs for real: ``storage_backends.s3_retry.AdaptiveLimiter`` (one per client, its clock the
model's clock, its wait a delay of the request, not a sleep) and the retry policy of a paced
``S3Store``: the store's ``Caller`` makes every try (``max_attempts x (retries + 1)``, 8 x 5 =
40 by default; botocore's retry quota is off), sleeping ``uniform(0, min(10, backoff x
2**(try - 1)))`` after a refused try (``storage_backends._s3_calls.Caller``). A client is one
store: ``threads`` requests in flight at most (a rank's 16 I/O threads), each try held for
``hold_s`` when accepted (its latency and its bytes) and ``refuse_s`` when refused.

What AWS documents: a prefix partition accepts 3,500 PUT/COPY/POST/DELETE and 5,500 GET/HEAD
requests per second, answers 503 SlowDown above that, and S3 splits a range under sustained
load. Assumptions of this model (AWS documents none of these numbers):

- one request is admitted or refused by the count of the range's accepted requests in its
  one-second window (whole seconds of the virtual clock) against ``partitions x rate``; a
  range's load spreads evenly over its partitions;
- a range kept at ``busy`` (90 %) of its capacity for ``split_after`` (120) seconds in a row
  splits in two, up to ``max_partitions``; a new step's keys start on one partition;
- ``aggregate`` = g > 1 runs N / g clients against a capacity of rate / g: g identical
  clients behave alike, so the range sees g copies of one client's traffic. Requests,
  SlowDowns and failures are reported multiplied back by g; durations are unchanged.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from storage_backends.s3_retry import DEFAULT_MIN_RATE, AdaptiveLimiter

__all__ = ["Client", "RequestPartitionModel"]


@dataclass
class Client:
    """One store's requests: ``count`` of them, the first sent at ``start``."""

    count: int
    start: float = 0.0
    limiter: AdaptiveLimiter | None = None
    next: int = 0  # requests handed to a thread
    done: int = 0  # succeeded or failed
    finished: float = 0.0
    failed: int = 0


@dataclass
class RequestPartitionModel:
    rate: float = 3500.0  # requests/s per partition: 3500 for PUTs, 5500 for GETs
    split_after: float = 120.0
    busy: float = 0.9
    max_partitions: int = 1024
    partitions: int = 1
    threads: int = 16  # requests in flight per client
    hold_s: float = 0.16  # an accepted try, answered (a 256 KiB PUT at a rank's share of its NIC)
    refuse_s: float = 0.02  # a refused try, answered
    attempts: int = 40  # S3Store, paced: max_attempts (8) x (retries (4) + 1), all of them its own
    backoff: float = 0.1  # S3Store's default backoff
    min_rate: float = DEFAULT_MIN_RATE
    aggregate: int = 1
    seed: int = 0
    # filled by run()
    issued: int = 0  # tries sent
    accepted: int = 0
    slowdowns: int = 0
    splits: list = field(default_factory=list)

    def run(self, clients: list[Client]) -> dict:
        """Plays every client's requests through the range; returns the figures (scaled by
        ``aggregate``) and checks its own bookkeeping."""
        rng = random.Random(self.seed)
        now = [0.0]
        cap = self.rate / self.aggregate  # per partition, per second
        parts = self.partitions
        window, in_window = -1, 0
        hot_since: int | None = None
        events: list = []
        seq = 0

        def push(t: float, kind: int, c: int, tries: int, sent: float = 0.0) -> None:
            nonlocal seq
            seq += 1
            heapq.heappush(events, (t, seq, kind, c, tries, sent))

        for i, cl in enumerate(clients):
            cl.limiter = AdaptiveLimiter(self.min_rate, clock=lambda: now[0], sleep=lambda s: None)
            for _ in range(min(self.threads, cl.count)):
                cl.next += 1
                push(cl.start, 0, i, 1)
        failed = 0
        last = 0.0
        max_wait = 0.0
        while events:
            t, _, kind, i, tries, sent = heapq.heappop(events)
            now[0] = t
            cl = clients[i]
            if kind == 0:  # a thread sends a try: its token first
                sent = cl.limiter.acquire("step")
                max_wait = max(max_wait, sent - t)
                if sent > t:
                    push(sent, 1, i, tries, sent)
                    continue
                kind = 1
            if kind == 1:  # the try reaches the range
                sec = int(t)
                if sec != window:
                    if window >= 0:  # the split rule judges each whole second
                        if in_window >= self.busy * parts * cap and parts < self.max_partitions:
                            hot_since = window if hot_since is None else hot_since
                            if window + 1 - hot_since >= self.split_after:
                                parts, hot_since = parts * 2, None
                                self.splits.append(window + 1)
                        else:
                            hot_since = None
                        if sec > window + 1:
                            hot_since = None  # an idle second between
                    window, in_window = sec, 0
                self.issued += 1
                if in_window < parts * cap:
                    in_window += 1
                    self.accepted += 1
                    push(t + self.hold_s, 2, i, tries, sent)
                else:
                    self.slowdowns += 1
                    push(t + self.refuse_s, 3, i, tries, sent)
                continue
            # an answer: the limiter hears it, then the thread retries or takes the next request
            throttled = kind == 3
            cl.limiter.record("step", sent, throttled)
            if throttled and tries < self.attempts:
                delay = rng.uniform(0.0, min(10.0, self.backoff * 2 ** (tries - 1)))
                push(t + delay, 0, i, tries + 1)
                continue
            if throttled:
                cl.failed += 1
                failed += 1
            cl.done += 1
            cl.finished = t
            last = max(last, t)
            if cl.next < cl.count:
                cl.next += 1
                push(t, 0, i, 1)
        total = sum(c.count for c in clients)
        assert sum(c.done for c in clients) == total, "a request was lost"
        assert self.issued == self.accepted + self.slowdowns
        assert self.accepted == total - failed, (self.accepted, total, failed)
        g = self.aggregate
        return {
            "requests": total * g,
            "tries": self.issued * g,
            "slowdowns": self.slowdowns * g,
            "failed": failed * g,
            "clients_failed": sum(1 for c in clients if c.failed) * g,
            "seconds": last,
            "splits": list(self.splits),
            "partitions": parts,
            "clients": len(clients),
            "aggregate": g,
            "waits": sum(c.limiter.waits for c in clients) * g,
            "max_wait_s": max_wait,  # the longest a try waited for its token
            "mean_wait_s": sum(c.limiter.waited_s for c in clients) / max(1, sum(c.limiter.waits for c in clients)),
        }


def aggregate_for(n: int, clients: int) -> int:
    """The g that runs ``n`` ranks as at most ``clients`` model clients (1 when n fits)."""
    return max(1, math.ceil(n / clients))
