"""Adaptive retries for the S3 store: after a SlowDown the store lowers its own request rate.

S3 answers 503 SlowDown when a key range (a partition) gets more requests than it accepts, and
splits the range only after minutes of sustained load (``benchmarks/SCALE.md``, the partition
model). Retrying with backoff alone keeps offering the refused load: the range stays saturated
with retries, and requests run out of tries. So, as TCP does and botocore's ``adaptive`` mode
does per client, the store paces itself:

- ``AdaptiveLimiter`` is one token bucket per *scope*, shared by every thread of the store (it
  sits on the botocore client's ``before-send`` and ``needs-retry`` events, so every request is
  paced, whoever retries it). A scope is the first folder of the key below the store's root
  (``step_0000000100``, ``_latest``, ...): one save's objects, the key range S3 throttles. A
  step's claims and heartbeats (``step_.../_claims/``) are a scope apart: behind 16 data
  reservations at the floor a heartbeat went out 80 s late, against a 60 s lease, and another
  job took a live writer's step over.
- A scope has no limit until a request in it is throttled (503, 429, ``THROTTLE_CODES``); then
  AIMD: its rate is cut to ``BETA`` of what it sent over the last second (never below
  ``min_rate``), every success adds ``STEP x cut rate / rate`` (``STEP`` x the cut rate per
  second), and back at ``RELEASE`` x the cut rate the limit is lifted.
- Why not botocore's ``retries={"mode": "adaptive"}``: its bucket is one per client, so a
  SlowDown on one step's range would also slow the store's reads of ``_latest/`` and claims;
  it sees only botocore's own tries, not our ``Caller``'s around them; and it cannot run on
  the simulator's virtual clock, where the same rule must be measured at 8192 ranks. The rule
  here is botocore's in spirit (its ``BETA`` is 0.7 too) with an additive, not CUBIC, regrowth.
- One cut per round trip: a throttle answering a request sent at or before the last cut says
  nothing about the new rate and is ignored, so 16 threads throttled by one burst cut the rate
  once, not 16 times (that would collapse it to ``min_rate``).

Bounded: a throttled request still counts as a try, so a call fails with one StorageError after
``max_attempts x (retries + 1)`` tries (all the store's ``Caller``'s, see
``storage_backends.s3``). The wait for a token is at most (requests waiting in the scope, itself
included) / ``min_rate``: a rate change credits what the old rate refilled first, so a request
pays for its token once, however many throttles follow. ``benchmarks/SCALE.md`` runs this
limiter, one per simulated client, against S3's partitions at 1024-8192 ranks.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

__all__ = ["BETA", "DEFAULT_MIN_RATE", "STEP", "THROTTLE_CODES", "AdaptiveLimiter", "Pacer", "scope_of"]

# Answers that mean "too many requests" (S3's SlowDown, and what other S3-compatible servers and
# botocore call throttling); a 503 or 429 status counts whatever its code.
THROTTLE_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequestsException",
    "RequestThrottled",
}
THROTTLE_STATUS = {429, 503}

BETA = 0.7  # a throttle cuts the rate to this share of what was sent over the last second (botocore: 0.7)
STEP = 0.5  # per second at full use, the rate grows by this share of the rate it was cut to
RELEASE = 2.0  # the limit is lifted once the rate is back at this multiple of the cut rate
DEFAULT_MIN_RATE = 0.2  # requests/s per scope, the floor of a cut: 8192 ranks x 0.2 < 3500 PUT/s
WINDOW = 1.0  # seconds over which the send rate is measured
MAX_SCOPES = 256  # buckets kept before the unlimited, idle ones are forgotten


LIVENESS = "_claims"  # a step's claims and lease renewals (``ckptd.manifest.CLAIMS``)


def scope_of(key: str) -> str:
    """The rate-limit scope of a key relative to the store's root: its first folder, except a
    step's claims and lease renewals (``<step>/_claims/...``), a scope of their own."""
    head, sep, rest = key.partition("/")
    if rest.partition("/")[0] == LIVENESS:
        return f"{head}/{LIVENESS}"
    return head if sep else ""


@dataclass
class _Bucket:
    rate: float | None = None  # requests/s; None: not limited
    cut_rate: float = 0.0  # the rate of the last cut
    tokens: float = 0.0
    refilled: float = 0.0
    last_cut: float = float("-inf")
    sent: collections.deque = field(default_factory=collections.deque)  # send times in WINDOW


class AdaptiveLimiter:
    """Token buckets per scope with AIMD rates; thread-safe. ``clock``/``sleep`` default to
    ``time.monotonic``/``time.sleep`` (the simulator passes virtual ones)."""

    def __init__(
        self,
        min_rate: float = DEFAULT_MIN_RATE,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not min_rate > 0:
            raise ValueError(f"min_rate must be positive, not {min_rate!r}")
        self.min_rate = min_rate
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._buckets: dict[str, _Bucket] = {}
        self.throttles = 0  # throttled responses seen
        self.cuts = 0  # rate decreases applied
        self.waits = 0  # sends that waited for a token
        self.waited_s = 0.0
        self.waits_by_thread: collections.Counter[str] = collections.Counter()  # thread name -> waits

    def rate(self, scope: str) -> float | None:
        with self._lock:
            b = self._buckets.get(scope)
            return b.rate if b else None

    def acquire(self, scope: str) -> float:
        """Before sending a request in ``scope``: wait for a token if the scope is limited.
        Returns the send time, to hand back to :meth:`record`."""
        with self._lock:
            now = self._clock()
            b = self._buckets.get(scope)
            if b is None:
                if len(self._buckets) >= MAX_SCOPES:  # a long job sees a scope per step: forget idle ones
                    idle = [k for k, x in self._buckets.items() if x.rate is None and x.sent[-1] < now - WINDOW]
                    for k in idle:
                        del self._buckets[k]
                b = self._buckets[scope] = _Bucket(refilled=now)
            wait = 0.0
            if b.rate is not None:
                _refill(b, now)
                b.tokens -= 1.0  # below zero: a reservation, paid by waiting
                if b.tokens < 0:
                    wait = -b.tokens / b.rate
                    self.waits += 1
                    self.waits_by_thread[threading.current_thread().name] += 1
                    self.waited_s += wait
            sent = now + wait
            b.sent.append(sent)
            while b.sent and b.sent[0] < sent - WINDOW:
                b.sent.popleft()
        if wait > 0:
            self._sleep(wait)
        return sent

    def record(self, scope: str, sent: float, throttled: bool) -> None:
        """After the answer to a request sent at ``sent`` in ``scope``."""
        with self._lock:
            b = self._buckets.get(scope)
            if b is None:
                return
            if throttled:
                self.throttles += 1
                if sent <= b.last_cut:
                    return  # sent at the old rate: already accounted for by the last cut
                measured = len(b.sent) / WINDOW
                base = measured if b.rate is None else min(b.rate, measured)
                b.last_cut = self._clock()
                b.cut_rate = max(self.min_rate, BETA * base)
                _set_rate(b, b.cut_rate, b.last_cut)
                self.cuts += 1
            elif b.rate is not None:
                rate = b.rate + STEP * b.cut_rate / b.rate
                _set_rate(b, None if rate >= RELEASE * b.cut_rate else rate, self._clock())


def _refill(b: _Bucket, now: float) -> None:
    """Credit the tokens ``b``'s current rate refilled since it was last refilled."""
    b.tokens = min(max(1.0, b.rate / 4), b.tokens + (now - b.refilled) * b.rate)
    b.refilled = now


def _set_rate(b: _Bucket, rate: float | None, now: float) -> None:
    """Change ``b``'s rate at ``now``, first crediting what the old rate refilled until now: a
    request that waited for its token paid for it (without that credit every throttle made the
    next request pay again, past any bound). Debt left is reservations not yet sent, re-priced to
    end when they were due. A cut keeps no burst saved at the old rate; no limit, no debt."""
    if rate is None or b.rate is None:
        b.tokens = 0.0
    else:
        _refill(b, now)
        if b.tokens < 0:
            b.tokens *= rate / b.rate
        elif rate < b.rate:
            b.tokens = 0.0
    b.rate = rate
    b.refilled = now


class Pacer:
    """Puts an ``AdaptiveLimiter`` in front of every request a botocore client sends (each try of
    botocore's own retries included), like botocore's adaptive mode, but per scope: ``scoped``
    names the key a call is about, for the requests this thread sends meanwhile."""

    def __init__(self, limiter: AdaptiveLimiter) -> None:
        self.limiter = limiter
        self._tls = threading.local()

    def attach(self, events) -> None:
        events.register("before-send.s3", self._before_send, unique_id="ckptd-pacer-send")
        events.register("needs-retry.s3", self._answered, unique_id="ckptd-pacer-answer")

    @contextlib.contextmanager
    def scoped(self, key: str) -> Iterator[None]:
        tls = self._tls
        outer = getattr(tls, "scope", "")
        tls.scope = scope_of(key)
        try:
            yield
        finally:
            tls.scope = outer

    def _before_send(self, **_) -> None:
        tls = self._tls
        tls.sent = self.limiter.acquire(getattr(tls, "scope", ""))
        return None  # botocore sends the request itself (a non-None answer would replace it)

    def _answered(self, response=None, **_) -> None:
        tls = self._tls
        sent = getattr(tls, "sent", None)
        if sent is None:
            return None
        tls.sent = None
        if response is None:
            return None  # no answer (a broken connection): neither a throttle nor a success
        http, parsed = response
        code = (parsed or {}).get("Error", {}).get("Code")
        throttled = code in THROTTLE_CODES or getattr(http, "status_code", None) in THROTTLE_STATUS
        self.limiter.record(getattr(tls, "scope", ""), sent, throttled)
        return None  # never decides botocore's retry
