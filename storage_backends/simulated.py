"""A simulated S3: the memory store behind request latency, LIST paging, per-prefix rate limits,
faults and a count of every request (as zarr's ``LatencyStore`` wraps another store).

It exists to run the real commit protocol at thousands of ranks on one small machine
(``python -m benchmarks.scale``) and to test that protocol under S3's failure modes. It is a test
and benchmark helper, never a backend a job root URI opens.

Time. With a :class:`VirtualClock`, every request *sleeps in simulated time*: each simulated
rank is a thread, but the clock lets exactly one of them run at a time and jumps the clock to
the next wake-up when the running one sleeps, so 8192 ranks waiting 20 ms each cost no wall
time and a run is deterministic for a seed. Code under simulation must block only through the
store or the clock (``clock.sleep``/``clock.time``); a thread that waits on anything else (a
lock another simulated thread holds across a request, a future of an unregistered pool) stalls
the simulation, which :meth:`VirtualClock.run` reports after a wall-clock timeout. Without a
clock the store sleeps for real (latency 0 by default), which is how the conformance suite runs
it from plain threads.

S3 behaviours modelled:

- latency per request drawn from a log-normal distribution (median ``latency``, shape
  ``sigma``), plus ``nbytes / bandwidth``;
- LIST returns at most ``page_size`` keys per request; pages are fetched lazily with a
  start-after marker, so a key written between two pages appears if it sorts after the marker,
  exactly as ListObjectsV2 pages behave;
- per-prefix rate limits: more than ``put_limit`` PUT/COPY/DELETE or ``get_limit`` GET/HEAD (LIST
  counts as a GET) accepted in any sliding ``window`` on one prefix are answered with
  ``SlowDownError`` (HTTP 503 SlowDown); the prefix of a key is its folder (everything up to the
  last ``/``), the prefix of a LIST the folder it lists;
- retries as botocore's "standard" mode does: up to ``attempts`` tries with full-jitter
  exponential backoff; every try is counted and every SlowDown is counted;
- with ``head_after_412``, the HEAD ``S3Store`` sends after a conditional put's 412, to read its
  writer token (off by default: the protocol tests' request bounds predate it);
- ``purge`` as ``S3Store``'s: every LIST page, then one DeleteObjects per 1000 keys;
  ``abort_stale_uploads`` one ListMultipartUploads;
- faults: ``error_rate`` transient 500s before the request takes effect, ``lost_rate`` responses
  lost after it took effect (the retry of a conditional put then finds its own object, as
  ``S3Store`` tells by a writer token).

Counters (:attr:`SimulatedStore.stats`): requests by verb, by (verb, prefix), SlowDowns, and the
peak accepted requests per ``window`` per prefix and class.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from storage_backends.base import (
    Data,
    ExistsError,
    NotFoundError,
    ObjectInfo,
    StorageError,
    Store,
    as_buffers,
    check_dir_prefix,
    check_key,
    check_prefix,
    resolve_range,
)
from storage_backends.memory import MemoryStore
from storage_backends.s3_retry import BETA, DEFAULT_MIN_RATE, RELEASE, STEP

GET_CLASS = "GET"  # GET, HEAD, LIST
PUT_CLASS = "PUT"  # PUT, COPY, DELETE
_CLASS = {
    "GET": GET_CLASS,
    "HEAD": GET_CLASS,
    "LIST": GET_CLASS,
    "PUT": PUT_CLASS,
    "COPY": PUT_CLASS,
    "DELETE": PUT_CLASS,
}


class SlowDownError(StorageError):
    """HTTP 503 SlowDown: the prefix is over its request rate, after every retry."""


class SimulationStalled(RuntimeError):
    """No simulated thread can run and some have not finished: one waits outside the clock."""


class VirtualClock:
    """Simulated time for threads: one registered thread runs at a time; ``sleep`` yields.

    ``spawn`` registers threads (from the driver before ``run``, or from a simulated thread);
    ``run`` starts the simulation and returns when every registered thread has finished,
    re-raising the first exception one of them raised. Threads wake in (time, registration
    order), so a run with seeded randomness is deterministic.
    """

    def __init__(self, stack_size: int = 512 * 1024, cpu_scale: float = 0.0) -> None:
        self.now = 0.0
        # cpu_scale > 0: the CPU time a simulated thread spends between two yields (measured with
        # time.thread_time, so other threads and processes on the machine do not inflate it) is
        # charged to its virtual time, times cpu_scale, before it sleeps or waits: the checks of
        # the code under test then take simulated time in proportion to what they cost here.
        self.cpu_scale = cpu_scale
        self.cpu_charged = 0.0  # simulated seconds charged for CPU, over all threads
        self._heap: list[tuple[float, int, threading.Lock]] = []
        self._seq = itertools.count()
        self._tls = threading.local()
        self._pending: list[threading.Thread] = []
        self._alive = 0
        self._done = threading.Event()
        self._errors: list[BaseException] = []
        self._guard = threading.Lock()  # only for the bookkeeping done by the driver thread
        self._stack_size = stack_size

    def time(self) -> float:
        return self.now

    def in_simulation(self) -> bool:
        return getattr(self._tls, "lock", None) is not None

    def spawn(self, fn: Callable[[], object], at: float | None = None, name: str = "sim") -> None:
        """Run ``fn`` in a new simulated thread from virtual time ``at`` (default: now)."""
        lock = threading.Lock()
        lock.acquire()

        def body() -> None:
            lock.acquire()  # our first turn
            self._tls.lock = lock
            self._tls.cpu = time.thread_time()
            try:
                fn()
            except BaseException as e:  # handed to run()
                self._errors.append(e)
            finally:
                self._alive -= 1
                self._tls.lock = None
                self._next()

        old = threading.stack_size()
        threading.stack_size(self._stack_size)
        try:
            t = threading.Thread(target=body, name=name, daemon=True)
        finally:
            threading.stack_size(old)
        self._alive += 1
        heapq.heappush(self._heap, (self.now if at is None else max(at, self.now), next(self._seq), lock))
        t.start()

    def sleep(self, seconds: float) -> None:
        """Let simulated time pass for this thread (a real short sleep outside a simulation)."""
        lock = getattr(self._tls, "lock", None)
        if lock is None:
            raise RuntimeError("VirtualClock.sleep called from a thread the clock did not spawn")
        heapq.heappush(self._heap, (self.now + max(0.0, seconds) + self._cpu(), next(self._seq), lock))
        self._next()
        lock.acquire()
        self._tls.cpu = time.thread_time()

    def _cpu(self) -> float:
        """The CPU this thread used since its turn began, scaled (0 without ``cpu_scale``)."""
        if self.cpu_scale <= 0:
            return 0.0
        used = max(0.0, time.thread_time() - getattr(self._tls, "cpu", time.thread_time())) * self.cpu_scale
        self.cpu_charged += used
        return used

    def wait(self, event: VirtualEvent) -> None:
        """Suspend this simulated thread until ``event`` is set (at once if it is)."""
        if self.cpu_scale > 0 and self.in_simulation():
            self.sleep(0.0)  # its CPU so far first
        if event.is_set:
            return
        lock = getattr(self._tls, "lock", None)
        if lock is None:
            raise RuntimeError("VirtualClock.wait called from a thread the clock did not spawn")
        event._waiters.append(lock)
        self._next()
        lock.acquire()
        self._tls.cpu = time.thread_time()

    def _next(self) -> None:
        if self._heap:
            t, _, lock = heapq.heappop(self._heap)
            self.now = max(self.now, t)
            lock.release()
        elif self._alive == 0:
            self._done.set()
        else:  # threads left, none scheduled: one blocks outside the clock
            self._errors.append(SimulationStalled(f"{self._alive} simulated threads blocked outside the clock"))
            self._done.set()

    def run(self, timeout: float = 600.0) -> float:
        """Run until every spawned thread finished; returns the virtual time at the end."""
        if self._alive == 0:
            return self.now
        self._done.clear()
        self._next()
        if not self._done.wait(timeout):
            raise SimulationStalled(f"simulation did not finish in {timeout} s of wall time")
        if self._errors:
            raise self._errors[0]
        return self.now


class VirtualEvent:
    """A one-shot event for simulated threads: ``clock.wait(event)`` suspends a thread without
    occupying the clock's schedule until another simulated thread calls ``set`` (no polling, so a
    task pool of simulated threads costs no wake-ups while it waits)."""

    def __init__(self, clock: VirtualClock) -> None:
        self._clock = clock
        self.is_set = False
        self._waiters: list[threading.Lock] = []

    def set(self) -> None:
        """Wake every waiter at the current virtual time (call it from a simulated thread)."""
        self.is_set = True
        for lock in self._waiters:
            heapq.heappush(self._clock._heap, (self._clock.now, next(self._clock._seq), lock))
        self._waiters.clear()


class VirtualTime:
    """A stand-in for the ``time`` module that reads and sleeps on a :class:`VirtualClock`;
    a simulation puts it in place of the ``time`` of the modules it runs (``mod.time = ...``),
    so their polling pauses and deadlines pass in simulated seconds."""

    def __init__(self, clock: VirtualClock, epoch: float = 1.7e9) -> None:
        self._clock, self._epoch = clock, epoch

    def time(self) -> float:
        return self._epoch + self._clock.time()

    def monotonic(self) -> float:
        return self._clock.time()

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        self._clock.sleep(seconds)

    def __getattr__(self, name: str):
        return getattr(time, name)


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


class SimulatedStore(Store):
    """``MemoryStore`` semantics behind S3's latency, paging, rate limits and faults.

    Thread-safe like every Store; with a clock, call it only from threads that clock spawned.
    """

    def __init__(
        self,
        clock: VirtualClock | None = None,
        *,
        latency: float = 0.0,
        sigma: float = 0.0,
        bandwidth: float = 1e9,
        page_size: int = 1000,
        put_limit: int = 3500,
        get_limit: int = 5500,
        window: float = 1.0,
        attempts: int = 8,
        backoff: float = 0.1,
        error_rate: float = 0.0,
        lost_rate: float = 0.0,
        seed: int = 0,
        prefix_of: Callable[[str], str] = folder_of,
        inner: MemoryStore | None = None,
        head_after_412: bool = False,
        delete_workers: int = 4,
    ) -> None:
        self.clock = clock
        self.delete_workers = max(1, delete_workers)
        self.head_after_412 = head_after_412
        self.latency, self.sigma, self.bandwidth = latency, sigma, bandwidth
        self.page_size = page_size
        self.limits = {PUT_CLASS: put_limit, GET_CLASS: get_limit}
        self.window = window
        self.attempts, self.backoff = max(1, attempts), backoff
        self.error_rate, self.lost_rate = error_rate, lost_rate
        self.rng = random.Random(seed)
        self.prefix_of = prefix_of
        self.inner = inner if inner is not None else MemoryStore()
        self.uri = f"sim+{self.inner.uri}"
        self.stats = Stats()
        self._lock = threading.Lock()
        self._keys: list[str] = []  # sorted index for paging
        self._infos: dict[str, ObjectInfo] = {}
        self.reindex()
        self._tokens: dict[str, int] = {}  # key -> writer token of its conditional put
        self._token = itertools.count(1)
        self._accepted: dict[tuple[str, str], collections.deque] = {}

    # -- time and requests ----------------------------------------------------------------------

    def now(self) -> float:
        return self.clock.time() if self.clock is not None else time.monotonic()

    def _sleep(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.clock is None:
            time.sleep(seconds)
        elif self.clock.in_simulation():
            self.clock.sleep(seconds)
        # else: the driver setting up or checking a simulation; that takes no simulated time

    def reindex(self) -> None:
        """Rebuild the listing index after writing to ``inner`` directly (uncounted setup)."""
        with self._lock:
            infos = list(self.inner.list())
            self._keys = [i.key for i in infos]
            self._infos = {i.key: i for i in infos}

    def _draw_latency(self, nbytes: int) -> float:
        if self.latency <= 0:
            return nbytes / self.bandwidth
        base = self.latency * math.exp(self.rng.gauss(0.0, self.sigma)) if self.sigma > 0 else self.latency
        return base + nbytes / self.bandwidth

    def _admit(self, cls: str, prefix: str, t: float) -> bool:
        """Count one arriving request against its prefix's window; False: SlowDown."""
        q = self._accepted.setdefault((cls, prefix), collections.deque())
        while q and q[0] <= t - self.window:
            q.popleft()
        if len(q) >= self.limits[cls]:
            return False
        q.append(t)
        k = (cls, prefix)
        if len(q) > self.stats.peak.get(k, 0):
            self.stats.peak[k] = len(q)
        return True

    def _request(self, verb: str, key_or_prefix: str, apply: Callable[[], object], nbytes: int = 0):
        """One request with its retries: arrive, maybe SlowDown/fail, take effect, take latency."""
        prefix = self.prefix_of(key_or_prefix)
        cls = _CLASS[verb]
        for attempt in range(1, self.attempts + 1):
            with self._lock:
                self.stats.requests[verb] += 1
                self.stats.by_prefix[(verb, prefix)] += 1
                admitted = self._admit(cls, prefix, self.now())
                if not admitted:
                    self.stats.slowdowns += 1
                fail = admitted and self.error_rate > 0 and self.rng.random() < self.error_rate
                lost = admitted and not fail and self.lost_rate > 0 and self.rng.random() < self.lost_rate
                delay = self._draw_latency(nbytes)
                if fail or lost:
                    self.stats.errors += 1
            if admitted and not fail:
                # Takes effect half-way through the round trip: the response comes back after.
                self._sleep(delay / 2)
                result = apply()
                self._sleep(delay / 2)
                if not lost:
                    return result
            else:
                self._sleep(delay)
            if attempt == self.attempts:
                what = "SlowDown (HTTP 503)" if not admitted else "InternalError (HTTP 500)"
                err = SlowDownError if not admitted else StorageError
                raise err(f"{self.uri}: {verb} {key_or_prefix!r} failed: {what} after {attempt} attempts")
            with self._lock:
                cap = min(20.0, self.backoff * 2 ** (attempt - 1))
                pause = self.rng.uniform(0, cap)
            self._sleep(pause)
        raise AssertionError("unreachable")

    # -- Store ----------------------------------------------------------------------------------

    def get(self, key: str, limit: int | None = None) -> bytes:
        check_key(key)
        return self._request("GET", key, lambda: self.inner.get(key, limit))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        check_key(key)

        def apply() -> bytes:
            data = self.inner.get(key)
            s = resolve_range(self.uri, key, start, length, len(data))
            return data[s : s + length]

        return self._request("GET", key, apply, length)

    def head(self, key: str) -> ObjectInfo:
        check_key(key)
        return self._request("HEAD", key, lambda: self.inner.head(key))

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
        except NotFoundError:
            return False
        return True

    def _index_add(self, key: str) -> None:
        self._infos[key] = self.inner.head(key)
        i = bisect.bisect_left(self._keys, key)
        if i == len(self._keys) or self._keys[i] != key:
            self._keys.insert(i, key)

    def _index_remove(self, key: str) -> None:
        self._infos.pop(key, None)
        i = bisect.bisect_left(self._keys, key)
        if i < len(self._keys) and self._keys[i] == key:
            del self._keys[i]

    def put(self, key: str, data: Data) -> None:
        check_key(key)
        blob = b"".join(as_buffers(data))

        def apply() -> None:
            with self._lock:
                self.inner.put(key, blob)
                self._tokens.pop(key, None)
                self._index_add(key)

        self._request("PUT", key, apply, len(blob))

    def put_if_absent(self, key: str, data: Data) -> bool:
        check_key(key)
        blob = b"".join(as_buffers(data))
        token = next(self._token)

        def apply() -> bool:
            with self._lock:
                if self.inner.put_if_absent(key, blob):
                    self._tokens[key] = token
                    self._index_add(key)
                    return True
                return False  # 412 Precondition Failed

        return self._request("PUT", key, apply, len(blob)) or self._ours(key, token)

    def _ours(self, key: str, token: int) -> bool:
        """After a 412, S3Store HEADs the object for its writer token (a retry after a lost
        response finds the object its first try wrote): one more request, as on S3, with
        ``head_after_412``; without, the answer is free (the store's older model)."""
        if not self.head_after_412:
            with self._lock:
                return self._tokens.get(key) == token
        try:
            return self._request("HEAD", key, lambda: self.inner.head(key) and self._tokens.get(key) == token)
        except NotFoundError:  # the winner's object is already deleted again
            return False

    def put_new(self, key: str, data: Data) -> object:
        check_key(key)
        blob = b"".join(as_buffers(data))
        token = next(self._token)

        def apply() -> bool:
            with self._lock:
                if self.inner.put_if_absent(key, blob):
                    self._tokens[key] = token
                    self._index_add(key)
                    return True
                return False  # 412; the HEAD tells a retry after a lost response

        if not (self._request("PUT", key, apply, len(blob)) or self._ours(key, token)):
            raise ExistsError(f"{self.uri}: {key!r} exists; a create-only write never replaces it")
        return token

    def delete_if(self, key: str, tag: object) -> bool:
        check_key(key)

        def apply() -> bool:
            with self._lock:
                if tag is None or self._tokens.get(key) != tag:
                    return False
                self.inner.delete(key)
                self._tokens.pop(key, None)
                self._index_remove(key)
                return True

        return self._request("DELETE", key, apply)

    def delete(self, key: str) -> None:
        check_key(key)

        def apply() -> None:
            with self._lock:
                self.inner.delete(key)
                self._tokens.pop(key, None)
                self._index_remove(key)

        self._request("DELETE", key, apply)

    def delete_prefix(self, prefix: str) -> int:
        """LIST pages, then one batch DELETE (DeleteObjects) per page, as S3Store does."""
        check_prefix(prefix)
        n = 0
        for page in self._pages(prefix):
            keys = [i.key for i in page]
            if not keys:
                continue

            def apply(keys=keys) -> None:
                with self._lock:
                    for k in keys:
                        self.inner.delete(k)
                        self._tokens.pop(k, None)
                        self._index_remove(k)

            self._request("DELETE", keys[0], apply)
            n += len(keys)
        return n

    def purge(self, prefix: str) -> tuple[int, int]:
        """As S3Store: LIST every page first, then one DeleteObjects of up to 1000 keys each,
        ``delete_workers`` in flight at once (simulated threads, under a clock)."""
        check_prefix(prefix)
        infos = [i for page in self._pages(prefix) for i in page]
        batches = [[x.key for x in infos[i : i + 1000]] for i in range(0, len(infos), 1000)]
        clock = self.clock
        if clock is None or not clock.in_simulation() or self.delete_workers == 1 or len(batches) < 2:
            for batch in batches:
                self._delete_batch(batch)
        else:
            todo, errors = list(reversed(batches)), []
            done, running = VirtualEvent(clock), [min(self.delete_workers, len(batches))]

            def worker() -> None:
                try:
                    while todo and not errors:
                        self._delete_batch(todo.pop())
                except BaseException as e:  # handed to the purging thread
                    errors.append(e)
                finally:
                    running[0] -= 1
                    if running[0] == 0:
                        done.set()

            for _ in range(running[0]):
                clock.spawn(worker, name="sim-delete")
            clock.wait(done)
            if errors:
                raise errors[0]
        return len(infos), sum(x.size for x in infos)

    def _delete_batch(self, batch: list[str]) -> None:
        if batch:

            def apply(batch=batch) -> None:
                with self._lock:
                    for k in batch:
                        self.inner.delete(k)
                        self._tokens.pop(k, None)
                        self._infos.pop(k, None)
                    # one slice of the sorted index per batch (a key at a time is quadratic)
                    gone = set(batch)
                    i, j = bisect.bisect_left(self._keys, batch[0]), bisect.bisect_right(self._keys, batch[-1])
                    self._keys[i:j] = [k for k in self._keys[i:j] if k not in gone]

            self._request("DELETE", batch[0], apply)

    def abort_stale_uploads(self, older_than: float, prefix: str = "") -> list[str]:
        """One ListMultipartUploads (counted as a LIST) that finds none: the simulation never
        leaves a multipart upload unfinished."""
        check_prefix(prefix)
        self._request("LIST", prefix or "/", lambda: None)
        return []

    def bulk_put(self, prefix: str, count: int) -> None:
        """Count ``count`` data PUTs under ``prefix`` without running them one by one (a
        benchmark's bulk upload, whose time it models itself and whose rate
        :class:`PartitionModel` judges): stats only, no time, no objects."""
        with self._lock:
            self.stats.requests["PUT"] += count
            self.stats.by_prefix[("PUT", self.prefix_of(prefix + "x"))] += count

    def copy(self, src_key: str, dst_key: str) -> None:
        check_key(src_key)
        check_key(dst_key)

        def apply() -> None:
            with self._lock:
                self.inner.copy(src_key, dst_key)
                self._tokens.pop(dst_key, None)
                self._index_add(dst_key)

        self._request("COPY", dst_key, apply)

    def _page(self, prefix: str, after: str | None, delimiter: bool) -> tuple[list, list[str], str | None]:
        """One LIST page: (objects, folders, marker of the next page or None)."""
        with self._lock:
            i = bisect.bisect_right(self._keys, after) if after is not None else bisect.bisect_left(self._keys, prefix)
            objects: list[ObjectInfo] = []
            folders: list[str] = []
            last = None
            while i < len(self._keys) and len(objects) + len(folders) < self.page_size:
                k = self._keys[i]
                if not k.startswith(prefix):
                    break
                rest = k[len(prefix) :]
                if delimiter and "/" in rest:
                    folder = rest.split("/", 1)[0]
                    folders.append(folder)
                    last = prefix + folder + "/\uffff"  # skip the whole folder, as S3 does
                    i = bisect.bisect_right(self._keys, last)
                    continue
                objects.append(self._infos[k])
                last = k
                i += 1
            more = i < len(self._keys) and self._keys[i].startswith(prefix)
            return objects, folders, (last if more else None)

    def _pages(self, prefix: str, delimiter: bool = False) -> Iterator[list[ObjectInfo]]:
        after = None
        while True:
            objects, folders, after = self._request("LIST", prefix, lambda a=after: self._page(prefix, a, delimiter))
            if objects or (not folders and after is None):
                yield objects
            if after is None:
                return

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_prefix(prefix)

        def gen() -> Iterator[ObjectInfo]:
            for page in self._pages(prefix):
                yield from page

        return gen()

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        return self._list_dir(check_dir_prefix(prefix), None)

    def list_dir_after(self, prefix: str, after: str) -> tuple[list[str], list[str]]:
        prefix = check_dir_prefix(prefix)
        names, folders = self._list_dir(prefix, prefix + after)  # S3's StartAfter
        return [n for n in names if n > after], [f for f in folders if f > after]

    def _list_dir(self, prefix: str, after: str | None) -> tuple[list[str], list[str]]:
        names: list[str] = []
        folders: list[str] = []
        while True:
            objects, subs, after = self._request("LIST", prefix, lambda a=after: self._page(prefix, a, True))
            names += [o.key[len(prefix) :] for o in objects]
            folders += subs
            if after is None:
                return sorted(names), sorted(set(folders))

    def exists_root(self) -> bool:
        return self.inner.exists_root()

    def close(self) -> None:
        self.inner.close()


__all__ = [
    "GET_CLASS",
    "PUT_CLASS",
    "PartitionModel",
    "SimulatedStore",
    "SimulationStalled",
    "SlowDownError",
    "Stats",
    "VirtualClock",
    "VirtualEvent",
    "VirtualTime",
    "folder_of",
]
