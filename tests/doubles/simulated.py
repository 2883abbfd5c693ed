"""A simulated S3: the memory store behind request latency, LIST paging, per-prefix rate limits,
faults and a count of every request (as zarr's ``LatencyStore`` wraps another store).

It exists to run the real commit protocol at thousands of ranks on one small machine
(``python -m benchmarks.scale``) and to test that protocol under S3's failure modes. It is a test
and benchmark helper, never a backend a job root URI opens.

Time: with a :class:`VirtualClock` (``sim_clock``, whose docstring tells the rules for code
under simulation) every request sleeps in simulated time. Without a clock the store sleeps for
real (latency 0 by default), which is how the conformance suite runs it from plain threads.

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

The clock lives in ``sim_clock``, the request classes and counters in
``sim_rates``; every name of ``__all__`` is still imported from here.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import random
import threading
import time
from collections.abc import Callable, Iterator

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
from tests.doubles.sim_clock import SimulationStalled, VirtualClock, VirtualEvent, VirtualTime
from tests.doubles.sim_rates import CLASS_OF, GET_CLASS, PUT_CLASS, Stats, folder_of


class SlowDownError(StorageError):
    """HTTP 503 SlowDown: the prefix is over its request rate, after every retry."""


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
        cls = CLASS_OF[verb]
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
        return self._put_conditional(key, data)[0]

    def put_new(self, key: str, data: Data) -> object:
        won, token = self._put_conditional(key, data)
        if not won:
            raise ExistsError(f"{self.uri}: {key!r} exists; a create-only write never replaces it")
        return token

    def _put_conditional(self, key: str, data: Data) -> tuple[bool, int]:
        """One PUT with If-None-Match: (whether this call created ``key``, its writer token).
        A 412 is still this call's win when the object carries its token (``_ours``)."""
        check_key(key)
        blob = b"".join(as_buffers(data))
        token = next(self._token)

        def apply() -> bool:
            with self._lock:
                if self.inner.put_if_absent(key, blob):
                    self._tokens[key] = token
                    self._index_add(key)
                    return True
                return False  # 412 Precondition Failed; the token tells a retry after a lost response

        return self._request("PUT", key, apply, len(blob)) or self._ours(key, token), token

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

    def _forget(self, key: str) -> None:
        """Drop ``key``, its writer token and its index entry (holding ``_lock``)."""
        self.inner.delete(key)
        self._tokens.pop(key, None)
        self._index_remove(key)

    def delete_if(self, key: str, tag: object) -> bool:
        check_key(key)

        def apply() -> bool:
            with self._lock:
                if tag is None or self._tokens.get(key) != tag:
                    return False
                self._forget(key)
                return True

        return self._request("DELETE", key, apply)

    def delete(self, key: str) -> None:
        check_key(key)

        def apply() -> None:
            with self._lock:
                self._forget(key)

        self._request("DELETE", key, apply)

    def delete_prefix(self, prefix: str) -> int:
        """LIST pages, then one batch DELETE (DeleteObjects) per page, as S3Store does."""
        check_prefix(prefix)
        n = 0
        for page in self._pages(prefix):
            keys = [i.key for i in page]  # sorted, as ``_delete_batch`` needs
            self._delete_batch(keys)
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
            jobs = [lambda batch=batch: self._delete_batch(batch) for batch in batches]
            clock.run_jobs(jobs, self.delete_workers, name="sim-delete")
        return len(infos), sum(x.size for x in infos)

    def _delete_batch(self, batch: list[str]) -> None:
        """One DeleteObjects of ``batch`` (sorted keys, as LIST pages are), if any."""
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
        ``tests.doubles.sim_requests`` judges): stats only, no time, no objects."""
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
    "SimulatedStore",
    "SimulationStalled",
    "SlowDownError",
    "Stats",
    "VirtualClock",
    "VirtualEvent",
    "VirtualTime",
    "folder_of",
]
