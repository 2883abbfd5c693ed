"""The simulated S3's request-rate side: request classes and per-prefix counters.

Invariants: every verb belongs to one rate class (``GET_CLASS``: GET, HEAD, LIST;
``PUT_CLASS``: PUT, COPY, DELETE), limited per prefix (``folder_of`` by default);
``Stats.requests`` counts tries, so a retried request counts each one.

No store and no clock here: ``tests.doubles.simulated`` counts its requests in ``Stats``;
``benchmarks.scale`` plays a save's bulk against S3's partitions with
``tests.doubles.sim_requests``.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

__all__ = ["CLASS_OF", "GET_CLASS", "PUT_CLASS", "Stats", "folder_of"]

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
