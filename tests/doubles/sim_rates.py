"""The simulated S3's request-rate side: request classes, per-prefix counters, and the
partition model of one key range under a save's bulk of PUTs.

Invariants: every verb belongs to one rate class (``GET_CLASS``: GET, HEAD, LIST;
``PUT_CLASS``: PUT, COPY, DELETE), limited per prefix (``folder_of`` by default);
``Stats.requests`` counts tries, so a retried request counts each one; ``PartitionModel``
is a fluid (rates per 50 ms tick, not single requests) whose pacing rule is the one
``storage_backends.s3_retry`` applies to the real store (``BETA``, ``STEP``, ``RELEASE``).

No store and no clock here: ``tests.doubles.simulated`` counts its requests in ``Stats``;
``benchmarks.scale`` plays a save's bulk through ``PartitionModel``.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

from storage_backends.s3_retry import BETA, DEFAULT_MIN_RATE, RELEASE, STEP

__all__ = ["CLASS_OF", "GET_CLASS", "PUT_CLASS", "PartitionModel", "Stats", "folder_of"]

GET_CLASS = "GET"  # GET, HEAD, LIST
PUT_CLASS = "PUT"  # PUT, COPY, DELETE
CLASS_OF = {
    "GET": GET_CLASS,
    "HEAD": GET_CLASS,
    "LIST": GET_CLASS,
    "PUT": PUT_CLASS,
    "COPY": PUT_CLASS,
    "DELETE": PUT_CLASS,
}


@dataclass
class Stats:
    """What the store served. ``requests`` counts tries (a retried request counts each try)."""

    requests: collections.Counter = field(default_factory=collections.Counter)  # verb -> n
    by_prefix: collections.Counter = field(default_factory=collections.Counter)  # (verb, prefix) -> n
    slowdowns: int = 0
    errors: int = 0  # injected transient errors and lost responses
    peak: dict = field(default_factory=dict)  # (class, prefix) -> most accepted in one window

    def total(self) -> int:
        return sum(self.requests.values())

    def peak_rate(self, cls: str | None = None) -> tuple[float, str]:
        """The highest accepted requests per window over all prefixes, and that prefix."""
        best = (0, "")
        for (c, prefix), n in self.peak.items():
            if (cls is None or c == cls) and n > best[0]:
                best = (n, prefix)
        return best

    def reset(self) -> None:
        self.requests.clear()
        self.by_prefix.clear()
        self.slowdowns = 0
        self.errors = 0
        self.peak.clear()


def folder_of(key: str) -> str:
    """The rate-limit prefix of a key: its folder ("" for a key at the root)."""
    return key.rpartition("/")[0]


@dataclass
class PartitionModel:
    """S3's partitions of one key range, as a fluid (rates, not single requests), for the bulk
    of a save: every object of a new ``step_N/`` sorts after every key written before, so the
    whole save lands in one partition. A partition accepts ``put_rate`` PUT/s (and
    ``get_rate`` GET/s); a range kept at least ``busy`` of its capacity for ``split_after``
    seconds splits in two (AWS: S3 "scales" a prefix under sustained load, over minutes, and
    answers 503 SlowDown meanwhile), up to ``max_partitions``. ``partitions`` > 1 models a range
    pre-partitioned before the save.

    :meth:`drain` plays ``clients`` writers through it, each with ``count`` PUTs offered evenly
    over its ``seconds`` from ``start``; refused PUTs retry as botocore's standard mode does
    (full-jitter backoff ``min(cap, base * 2**k)``, at most ``attempts`` tries, the mean delay
    of each retry), or, with ``paced``, each client also paces its PUTs as ``S3Store``'s
    adaptive mode does (the rule of ``storage_backends.s3_retry``: halve on a SlowDown, grow
    back additively)."""

    put_rate: float = 3500.0
    get_rate: float = 5500.0
    split_after: float = 120.0
    busy: float = 0.9
    max_partitions: int = 1024
    partitions: int = 1
    base: float = 1.0
    cap: float = 20.0
    attempts: int = 40  # S3Store: botocore's 8 tries x (4 + 1) of its own Caller
    min_rate: float = DEFAULT_MIN_RATE  # paced: each client's floor, PUT/s (S3Store's min_rate)

    def drain(self, offers: list[tuple[float, float, int]], paced: bool = False, dt: float = 0.05) -> dict:
        """``offers``: (start s, seconds, PUTs) per client. Returns the time the last PUT was
        accepted, the SlowDowns (refused tries), the PUTs that exhausted their tries (each
        fails its rank's save), and the splits with their times.

        ``paced`` is ``S3Store``'s adaptive mode (``storage_backends.s3_retry``), the same rule
        as a fluid: the clients send what they have until a try is refused, then the range's
        senders cut their rates to ``BETA`` of what they sent (once per tick: the rule's one
        cut per round trip), never below ``min_rate`` each, and grow back by ``STEP`` x the cut
        rate per second, lifting the limit at ``RELEASE`` x; refused tries still retry with
        backoff, paced too."""
        parts, hot_since, t = self.partitions, None, 0.0
        total = sum(c for _, _, c in offers)
        accepted = slowdowns = failed = 0.0
        retry_att: dict[int, dict[int, float]] = collections.defaultdict(
            lambda: collections.defaultdict(float)
        )  # tick -> try -> PUTs
        backlog = 0.0  # paced: offered but held by the clients' token buckets
        limit: float | None = None  # paced: the senders' summed rate, PUT/s (None: not limited)
        cut = 0.0
        floor = len(offers) * self.min_rate
        splits: list[float] = []
        tick = 0
        last = 0.0
        # PUTs offered per tick: each client's count spread evenly over its seconds
        arrivals = [0.0] * (int(max((a + b for a, b, _ in offers), default=0.0) / dt) + 2)
        for start, secs, count in offers:
            i, j = int(start / dt), int((start + secs) / dt)
            per = count / max(1, j - i + 1)
            for k in range(i, j + 1):
                arrivals[k] += per
        while accepted + failed < total - 1e-6:
            new = arrivals[tick] if tick < len(arrivals) else 0.0
            capacity = parts * self.put_rate * dt
            by_att = retry_att.pop(tick, {})
            if paced:
                backlog += new
                allowed = math.inf if limit is None else limit * dt
                due = sum(by_att.values())
                if due > allowed:  # retries the bucket holds back wait a tick, keeping their try
                    keep = allowed / due
                    for att, n in by_att.items():
                        retry_att[tick + 1][att] += n * (1 - keep)
                    by_att = {att: n * keep for att, n in by_att.items()}
                    due = allowed
                new = min(backlog, allowed - due)
                backlog -= new
            offered = new + sum(by_att.values())
            took = min(offered, capacity)
            accepted += took
            load = took
            refused = offered - took
            slowdowns += refused
            if refused > 0:
                share = refused / offered
                for att, n in [(1, new), *by_att.items()]:
                    back = n * share
                    if att + 1 > self.attempts:
                        failed += back
                        continue
                    delay = min(self.cap, self.base * 2 ** (att - 1)) / 2
                    retry_att[tick + max(1, round(delay / dt))][att + 1] += back
                if paced:
                    limit = cut = max(floor, BETA * offered / dt)
            elif paced and limit is not None:
                limit += took * STEP * cut / limit  # each success adds STEP * cut / rate, as there
                if limit >= RELEASE * cut:
                    limit = None
            if took > 0:
                last = t + dt
            if load >= self.busy * capacity and parts < self.max_partitions:
                hot_since = t if hot_since is None else hot_since
                if t + dt - hot_since >= self.split_after:
                    parts, hot_since = parts * 2, None
                    splits.append(round(t + dt, 2))
            else:
                hot_since = None
            t += dt
            tick += 1
            if t > 1e6:
                raise RuntimeError("partition model did not drain")
        return {
            "seconds": last,
            "slowdowns": round(slowdowns),
            "exhausted": round(failed),
            "splits": splits,
            "partitions": parts,
            "puts": total,
        }
