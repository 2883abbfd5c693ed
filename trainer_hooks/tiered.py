"""Restoring from the memory tiers: one read-only ``Store`` of one (step, attempt) over the
daemons that hold it, falling back to the job root (docs/operations.md, "A node died").

``TieredRestore`` (one per ``Checkpointer`` with a daemon) asks the daemons what they hold
(``walk``: the rank's own daemon, then the peers it names) and builds a ``TierSource`` for each
step a restore tries: a committed step (``source``) or the newest whole memory-only step
(``trainer_hooks.memsteps`` chooses it). The one restore path (``restore._restore_step``) reads
the step through that store: each shard from its own node's daemon (its sealed memory mapped),
then a peer daemon (the data path, in batches), then the job root (none for a memory-only step:
the restore then fails and the next candidate is tried).

Trust: a tier is a cache, never a source of truth. Every chunk read from a tier is checked
against the crc32c stored with it and the writers' pins, and every answer must carry the step
and attempt asked for and exactly the bytes asked for. A tier that is gone or slower than
``timeout_s`` is skipped for the rest of the restore; a shard that fails any check is read again
from the next tier, at last from the job root. So a tier can make a restore slower, never make it
fail or return other values than the job root holds.

Thread safety: ``TieredReader.read_shard`` runs on the restore's pool; tier state (dead or
alive) and the per-tier byte counts are guarded by a lock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import NoReturn
from urllib.parse import urlencode

from ckptd import catalog
from ckptd import manifest as mf
from ckptd.auth import daemon_token
from ckptd.codec import CRC_BYTES
from ckptd.daemon_conn import VOUCH_S, DaemonUnreachable
from ckptd.errors import CheckpointError
from ckptd.reader import CheckpointReader, ReadRequest, run_all
from ckptd.tierwire import ask_json
from storage_backends import NotFoundError, StorageError, Store
from storage_backends.base import ObjectInfo, as_writable_buffers, check_limit, resolve_range
from trainer_hooks.coord import from_rank0
from trainer_hooks.tierstore import (
    BATCH_BYTES,
    DEFAULT_TIER_TIMEOUT_S,
    TierStore,
    TierUnavailable,
    _Fetched,
    _RangeReads,
)

__all__ = ["DEFAULT_TIER_TIMEOUT_S", "TierSource", "TierStore", "TieredReader", "TieredRestore"]

log = logging.getLogger("ckptd.tiered")

SURVEY_S = 0.8  # a peer silent this long is left out of a restore (CKPTD_TIER_SURVEY_S)


class _Tier:
    def __init__(self, store: TierStore, kind: str, prefix: str):
        self.store, self.kind, self.prefix = store, kind, prefix
        self.dead = False

    def reader(self, pins=None, store=None) -> CheckpointReader:
        """A reader of this tier (or of ``store``, bytes fetched from it) for one shard: its byte
        count is the shard's alone; every chunk is checked against ``pins`` (the committing
        attempt's, ``ckptd.pins``) where given."""
        where = f"{self.store.name} (memory tier)"
        return CheckpointReader(store or self.store, self.prefix, where=where, pins=pins)  # type: ignore[arg-type]


class TieredReader(CheckpointReader):
    """The ``CheckpointReader`` of a ``TierSource``: each shard from the first tier holding it
    (nearest first), else from the job root (for a memory-only step, none: a StorageError)."""

    def __init__(self, source: TierSource, prefix: str, pins=None):
        super().__init__(source.root or source, prefix, pins=pins)
        self._source = source

    def read(self, requests, pool=None) -> None:
        """Fill every request's ``out``. The shard objects a live tier holds are fetched in
        batches of ``BATCH_BYTES`` per tier (the per-request cost is paid per batch), each batch on
        the pool with the reads of its shards (at most a pool's worth of batches in memory); a
        larger range is read straight into the tensors. Every chunk is then checked as any read's.
        A batch that fails marks its tier dead and leaves its shards to the per-shard path."""
        tasks = self.plan(requests)
        by_key: dict[str, list] = {}  # key -> [tier, lo, hi, tasks]
        plain = []
        for req, sr in tasks:
            key = self._object(req.entry, sr.shard)
            tier = next((t for t in self._source.holders_of(key) if not t.dead), None)
            if tier is None or not BATCH_BYTES or not tier.store.batched:
                plain.append((req, sr))
                continue
            layout = req.entry.layout
            spans = self._computed_spans(layout, sr) if layout.sharded else [(0, layout.chunk_nbytes + CRC_BYTES, ())]
            lo, hi = min(o for o, _, _ in spans), max(o + m for o, m, _ in spans)
            got = by_key.setdefault(key, [tier, lo, hi, []])
            got[1], got[2] = min(got[1], lo), max(got[2], hi)
            got[3].append((req, sr))
        batches: list[tuple[_Tier, list[str]]] = []
        filling: dict[int, tuple[_Tier, list[str], int]] = {}  # id(tier) -> (tier, keys, bytes)
        for key, (tier, lo, hi, waiting) in by_key.items():
            if hi - lo > BATCH_BYTES:
                # A large range gains nothing from batching and would be held whole in a buffer:
                # its shards stream straight into the caller's tensors (one GET per coalesced range).
                plain += waiting
                continue
            _, keys, size = filling.get(id(tier), (tier, [], 0))
            if keys and size + hi - lo > BATCH_BYTES:
                batches.append((tier, keys))
                keys, size = [], 0
            keys.append(key)
            filling[id(tier)] = (tier, keys, size + hi - lo)
        batches += [(tier, keys) for tier, keys, _ in filling.values()]

        def run_batch(tier: _Tier, keys: list[str]) -> None:
            fetched = None
            if not tier.dead:
                ranges = [(k, by_key[k][1], by_key[k][2] - by_key[k][1]) for k in keys]
                try:
                    buf = memoryview(tier.store.get_batch(ranges))
                    fetched = _Fetched(tier.store.name)
                    pos = 0
                    for k, lo, n in ranges:
                        fetched.held[k] = (lo, buf[pos : pos + n])
                        pos += n
                except TierUnavailable as e:
                    self._source.failed(tier, e)
            for k in keys:
                for req, sr in by_key[k][3]:
                    self._read_one(req, sr, (tier, fetched) if fetched is not None else None)

        run_all(pool, [(run_batch, b) for b in batches] + [(self._read_one, (r, sr, None)) for r, sr in plain])

    def read_shard(self, req: ReadRequest, sr) -> None:
        self._read_one(req, sr, None)

    def _read_one(self, req: ReadRequest, sr, fetched) -> None:
        """Read one shard: from the bytes a batch fetched (``fetched``: (tier, _Fetched)), else
        from the first other live tier holding it, else from the job root."""
        done = None  # the tier whose fetched bytes failed: not asked again for this shard
        if fetched is not None:
            done, store = fetched
            if self._read_from(done, done.reader(self.pins, store), req, sr):
                return
        for tier in self._source.holders_of(self._object(req.entry, sr.shard)):
            if not tier.dead and tier is not done and self._read_from(tier, tier.reader(self.pins), req, sr):
                return
        super().read_shard(req, sr)  # the job root: the chunks the plan reads, checked the same way

    def _read_from(self, tier: _Tier, reader: CheckpointReader, req: ReadRequest, sr) -> bool:
        """Whether ``reader`` (of ``tier``, or of bytes fetched from it) read the shard, every
        chunk checked against its crc32c. A tier that does not answer is skipped for the rest of
        the restore; a bad chunk (or a range a batch did not fetch) only for this shard."""
        try:
            reader.read_shard(req, sr)
        except (TierUnavailable, CheckpointError, StorageError) as e:
            if isinstance(e, TierUnavailable) and reader.store is tier.store:
                self._source.failed(tier, e)
            else:
                self._source.refused(self._object(req.entry, sr.shard), e)
            return False
        self._source.count(tier, reader.stats.bytes_read)
        return True


class TierSource(_RangeReads, Store):
    """A read-only store of one (step, attempt) over the daemons that hold its objects
    (``holders``: key -> (size, daemon URLs, this rank's own daemon first); ``data``: the data
    path each advertised), wrapped around ``root`` (the job root; None for a memory-only step,
    whose ``commit`` record is served as its ``commit.json``), read nearest first (module doc)."""

    def __init__(self, tiers: TieredRestore, step: int, attempt: str, holders, data, root=None, commit=None):
        self.uri = root.uri if root is not None else f"{tiers.root_uri.rstrip('/')} [memory tiers]"
        self.tiers, self.step, self.attempt = tiers, step, attempt
        self.holders: dict[str, tuple[int, list[str]]] = holders
        self.root, self.commit = root, commit
        self._data: dict = data or {}
        self._commit_key = f"{mf.step_dir(step)}/{mf.COMMIT}"
        self._lock = threading.Lock()
        self._tiers: dict[str, _Tier] = {}
        self._mapped: _Tier | None = None  # this node's daemon's objects, mapped (``map_own``)
        self._reader: TieredReader | None = None
        self._refused: set[str] = set()  # shards a tier's copy of failed a check (logged once)
        # chunk bytes each tier kind served (a tier's bytes that failed a check count for none)
        self.bytes = {"local": 0, "peer": 0}

    def _tier(self, url: str) -> _Tier:
        with self._lock:
            t = self._tiers.get(url)
            if t is None:
                # the own daemon, by the address this rank dialled (its socket: the kernel names
                # the rank, whose root a daemon may refuse to a TCP caller) or by its --advertise URL
                own = url in (self.tiers.daemon_url, self.tiers.advertised)
                name = f"{'daemon' if own else 'peer'} {url}"
                dial = self.tiers.daemon_url if own else url
                ts = TierStore(
                    dial, name, self.tiers.root_uri, self.step, self.attempt, self.tiers._token, self.tiers.timeout_s
                )
                ts.use_data(self._data.get(url), unix=own)
                ts.vouch = ts._http.vouch = None if own else self.tiers.ticket
                t = self._tiers[url] = _Tier(ts, "local" if own else "peer", mf.step_dir(self.step))
                t.dead = url in self.tiers.silent
            return t

    def holders_of(self, key: str) -> list[_Tier]:
        """The tiers that hold ``key``, nearest first."""
        got = self.holders.get(key)
        if got is None:
            return []
        mapped = [self._mapped] if self._mapped is not None and key in self._mapped.store.held else []
        return mapped + [self._tier(u) for u in got[1]]

    def failed(self, tier: _Tier, e: Exception) -> None:
        """``tier`` did not answer or answered wrong: skip it for the rest of the restore."""
        with self._lock:
            first, tier.dead = not tier.dead, True
        if isinstance(e, TierUnavailable):
            self.tiers.silent.add(tier.store.uri)
        if first:
            log.warning("restore: skipping the memory tier %s: %s", tier.store.name, e)

    def refused(self, key: str, e: Exception) -> None:
        """A tier's copy of shard ``key`` failed a check: logged once per shard and restore (this
        node's daemon serves one copy through its mapped memory, its socket and its --advertise
        URL, and each refuses it alike), later refusals at DEBUG."""
        with self._lock:
            first = key not in self._refused
            self._refused.add(key)
        (log.warning if first else log.debug)("restore: %s; reading that shard from the next tier", e)

    def map_own(self) -> None:
        """Map every object this rank's own daemon holds from the sealed memory it passes on its
        Unix data socket; where that fails the objects are read over the data path."""
        own = self.tiers.daemon_url
        if os.environ.get("CKPTD_TIER_SHARED_MEMORY", "1") == "0":
            return
        keys = sorted(k for k, (size, urls) in self.holders.items() if size > 0 and own in urls)
        if not keys:
            return
        tier = self._tier(own)
        if tier.store.data_socket is None:
            return
        try:
            self._mapped = _Tier(tier.store.map_objects(keys), "local", tier.prefix)  # type: ignore[arg-type]
        except TierUnavailable as e:
            log.info("restore: reading this node's tier copy over its socket: %s", e)
            tier.store.data_socket = None
        tier.store.close()

    def reader(self, prefix: str, pins=None) -> TieredReader:
        """The reader ``restore._restore_step`` reads the step's chunks with."""
        self._reader = TieredReader(self, prefix, pins)
        return self._reader

    def count(self, tier: _Tier, nbytes: int) -> None:
        with self._lock:
            self.bytes[tier.kind] += nbytes

    def tier_bytes(self) -> dict[str, int]:
        """Bytes the restore read from this node's daemon, from peers and from the job root."""
        with self._lock:
            return {**self.bytes, "root": self._reader.stats.bytes_read if self._reader is not None else 0}

    def close(self) -> None:
        """Close every daemon's connections and forget the mapped objects (the restore is over)."""
        with self._lock:
            tiers, self._tiers = list(self._tiers.values()), {}
        for t in [*tiers, *([self._mapped] if self._mapped is not None else [])]:
            t.store.close()

    def _size(self, key: str) -> int:
        if key == self._commit_key and self.commit is not None:
            return len(mf.dumps(self.commit))
        got = self.holders.get(key)
        if got is None:
            raise NotFoundError(f"{self.uri}: no object {key!r}")
        return got[0]

    def get(self, key: str, limit: int | None = None) -> bytes:
        if self.root is not None and key not in self.holders:
            return self.root.get(key, limit)
        size = self._size(key)
        check_limit(self.uri, key, size, limit)
        return self.get_range(key, 0, size)

    def get_range_into(self, key: str, start: int, buffers) -> None:
        if self.root is not None and key not in self.holders:
            self.root.get_range_into(key, start, buffers)
            return
        views = as_writable_buffers(buffers)
        length = sum(v.nbytes for v in views)
        begin = resolve_range(self.uri, key, start, length, self._size(key))
        if key == self._commit_key and self.commit is not None:
            data = memoryview(mf.dumps(self.commit))[begin : begin + length]
            for v in views:
                v[:], data = data[: v.nbytes], data[v.nbytes :]
            return
        for tier in self.holders_of(key):
            if tier.dead:
                continue
            try:
                tier.store.get_range_into(key, begin, views)
            except (TierUnavailable, CheckpointError) as e:  # gone, slow, wrong answer, or a bad URL
                self.failed(tier, e)
                continue
            self.count(tier, length)
            return
        if self.root is not None:
            self.root.get_range_into(key, begin, views)
            return
        raise StorageError(f"{self.uri}: no live daemon serves {key!r}")

    def _read_only(self, *_) -> NoReturn:
        raise StorageError(f"{self.uri}: read-only")

    put = put_if_absent = delete = _read_only

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if self.root is not None:
            yield from self.root.list(prefix)
            return
        keys = set(self.holders) | ({self._commit_key} if self.commit is not None else set())
        for k in sorted(k for k in keys if k.startswith(prefix)):
            yield ObjectInfo(k, self._size(k), 0.0)

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        if self.root is not None:
            return self.root.list_dir(prefix)
        rest = [info.key[len(prefix) :].partition("/") for info in self.list(prefix)]
        return [h for h, sep, _ in rest if not sep], sorted({h for h, sep, _ in rest if sep})


class TieredRestore:
    """The memory tiers of one job root as a restoring rank sees them: ``walk`` (what the
    daemons hold), ``source`` (the store of one step to restore), ``report`` and ``fence``."""

    def __init__(self, daemon_url: str, root_uri: str, timeout_s: float | None = None):
        self.daemon_url = daemon_url.rstrip("/")
        self.root_uri = root_uri
        env = os.environ.get("CKPTD_TIER_TIMEOUT_S")
        self.timeout_s = timeout_s if timeout_s is not None else float(env) if env else DEFAULT_TIER_TIMEOUT_S
        self.survey_s = min(self.timeout_s, float(os.environ.get("CKPTD_TIER_SURVEY_S") or SURVEY_S))
        self.last: dict[str, int] = {}
        self._token = daemon_token()
        self.silent: set[str] = set()  # daemons that did not answer in this restore (``_ask_all``)
        self.advertised: str | None = None  # the own daemon's --advertise URL (``walk``)
        self._ticket: tuple[str | None, float] = (None, -VOUCH_S)  # (``ticket``, when it was asked)
        self._ticket_lock = threading.Lock()

    def begin(self) -> None:
        """A restore starts: every daemon is asked again (one silent before may be back)."""
        self.silent.clear()
        self._ticket = (None, -VOUCH_S)

    def ticket(self) -> str | None:
        """This rank's ticket for this root from its own daemon (``GET /v1/tiers/vouch`` on its
        socket), asked again once half its life is gone: peers read a bound root to whom it
        names only. None without one (peers read this rank as a TCP caller)."""
        if not self.daemon_url.startswith("unix://"):
            return None
        with self._ticket_lock:
            text, asked = self._ticket
            if time.monotonic() - asked < VOUCH_S / 2:
                return text
            path = f"/v1/tiers/vouch?{urlencode({'root': self.root_uri})}"
            try:
                text = ask_json(self.daemon_url, self._token, self.timeout_s, "GET", path)["vouch"]
            except (ValueError, KeyError, CheckpointError) as e:
                text = None
                log.debug(
                    "restore: no ticket from %s (%s): its peers read this rank as a TCP caller", self.daemon_url, e
                )
            self._ticket = (text, time.monotonic())
            return text

    def walk(self, urls: list[str], step: int | None = None, attempt: str | None = None, follow: bool = True):
        """The one peer walk: ask each daemon of ``urls`` (and, with ``follow``, the peers this
        rank's own daemon names) what it holds complete of this root (of exactly ``step`` and
        ``attempt`` when given). Returns ((step, attempt) -> key -> (size, [URLs], in the order
        asked); URL -> its advertised data path; the URLs that answered; the peers the own
        daemon named). Own daemon is named by its ``--advertise`` URL where it has one (this
        rank may have dialled its socket; other nodes' ranks cannot). The own daemon is asked
        first; the peers all at once, each given ``survey_s``: one that does not answer in that
        time (stopped, partitioned) is left out, as one that refuses (logged)."""
        held: dict[tuple[int, str], dict[str, tuple[int, list[str]]]] = {}
        data: dict[str, dict] = {}
        asked: list[str] = []
        named: list[str] = []
        q = {"root": self.root_uri, "keys": "true"} | ({} if step is None else {"step": step, "attempt": attempt})
        path = "/v1/tiers?" + urlencode(q)
        todo = list(dict.fromkeys(u.rstrip("/") for u in urls))
        answers = self._ask_all([u for u in todo if u == self.daemon_url], "GET", path, self.timeout_s)
        if answers and isinstance(answers[0][1], dict):
            named = [p.rstrip("/") for p in answers[0][1].get("peers", []) if isinstance(p, str)]
            todo += named if follow else []
        answers += self._ask_all([u for u in dict.fromkeys(todo) if u != self.daemon_url], "GET", path)
        for url, body in answers:
            try:
                if isinstance(body, Exception):
                    raise body
                found = [
                    ((int(c["step"]), str(c["attempt"])), {str(k): int(v) for k, v in c["keys"].items()})
                    for kind in ("hot", "replicas", "memory_only")
                    for c in body.get(kind, [])
                ]
            except (ValueError, KeyError, TypeError, AttributeError, CheckpointError) as e:
                log.warning("restore: the memory tier of %s did not answer: %s", url, e)
                continue
            asked.append(url)
            own = url == self.daemon_url and isinstance(body.get("advertise"), str)
            name = body["advertise"].rstrip("/") if own else url  # reachable from other nodes
            self.advertised = name if own else self.advertised
            if isinstance(body.get("data"), dict):
                data[name] = body["data"]
            for gid, keys in found:
                table = held.setdefault(gid, {})
                for k, size in keys.items():
                    got = table.setdefault(k, (size, []))
                    if got[0] == size and name not in got[1]:
                        got[1].append(name)
        return held, data, asked, named

    def _ask_all(self, urls: list[str], method: str, path: str, timeout_s: float | None = None, body=None):
        """Ask every daemon of ``urls`` at once, a thread each, each request bounded by
        ``timeout_s`` (default ``survey_s``); wait ``survey_s`` at most for the set (the own
        daemon, asked with its full timeout: that long). Returns [(url, its answer or the
        error)] in order; a daemon still silent is a DaemonUnreachable, its request left to end
        on its own thread. One that did not answer (gone or silent) goes in ``silent``: not
        asked again, nor listed, in this restore."""
        timeout_s = self.survey_s if timeout_s is None else timeout_s
        urls = [u for u in urls if u not in self.silent]
        got: dict[str, object] = {}
        vouch = self.ticket()  # asked before the set: its own daemon's answer is not raced by the survey

        def ask(url: str) -> None:
            try:
                got[url] = ask_json(url, self._token, timeout_s, method, path, body, vouch=vouch)
            except (ValueError, CheckpointError) as e:
                got[url] = e

        threads = [threading.Thread(target=ask, args=(u,), daemon=True, name="ckptd-survey") for u in urls]
        for t in threads:
            t.start()
        deadline = time.monotonic() + max(timeout_s if urls == [self.daemon_url] else 0.0, self.survey_s)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        silent = f"no answer within {self.survey_s:g} s (CKPTD_TIER_SURVEY_S)"
        answers = [(u, got.get(u, DaemonUnreachable(f"{u}: {silent}"))) for u in urls]
        self.silent.update(u for u, a in answers if isinstance(a, DaemonUnreachable))
        return answers

    def source(self, store: Store, coord, step: int) -> TierSource:
        """The store of committed ``step`` over the tiers, wrapped around the job root ``store``.
        Collective, never raises: rank 0 reads the commit record's attempt and asks the peers its
        daemon names, every rank its own daemon; a tier that cannot say what it holds is left
        out (then every shard comes from the root)."""
        attempt = from_rank0(
            coord,
            lambda: (catalog.read_commit(store, step) or {}).get("attempt"),
            fail=lambda e: log.warning("restore: no tier read of step %d: %s", step, e),
        )
        if not isinstance(attempt, str):
            return TierSource(self, step, "", {}, {}, store)
        held, data, _, peers = self._own(step, attempt)
        theirs: tuple = ({}, {})
        if coord.rank == 0:
            got, pdata, _, _ = self.walk([p for p in peers if p != self.daemon_url], step, attempt, follow=False)
            theirs = (got.get((step, attempt), {}), pdata)
        theirs = coord.broadcast(theirs)
        holders = held.get((step, attempt), {})
        for k, (size, urls) in theirs[0].items():
            mine = holders.setdefault(k, (size, []))
            if mine[0] == size:
                mine[1].extend(u for u in urls if u != self.daemon_url and u not in mine[1])
        src = TierSource(self, step, attempt, holders, {**theirs[1], **data}, store)
        src.map_own()
        return src

    def _own(self, step: int, attempt: str):
        """``walk`` of this rank's own daemon alone, for (step, attempt), named by the address
        this rank dialled (its parts are then read as this node's: mapped, on its socket)."""
        held, data, asked, peers = self.walk([self.daemon_url], step, attempt, follow=False)
        held = {g: {k: (n, [self.daemon_url]) for k, (n, _) in t.items()} for g, t in held.items()}
        return held, ({self.daemon_url: next(iter(data.values()))} if data else {}), asked, peers

    def memory_only_source(self, attempt: str, step: int, holders, commit: dict, data) -> TierSource:
        """The store of memory-only (step, attempt) that ``memsteps.choose`` found whole: no job
        root behind it; this rank's own daemon asked for its parts first (mapped, on its socket)."""
        mine, own_data, _, _ = self._own(step, attempt)
        for k, (size, _) in mine.get((step, attempt), {}).items():
            got = holders.get(k)
            if got is not None and got[0] == size:
                holders[k] = (size, [self.daemon_url, *(u for u in got[1] if u != self.daemon_url)])
        src = TierSource(self, step, attempt, holders, {**data, **own_data}, None, commit)
        src.map_own()
        return src

    def rebuild(self) -> None:
        """Ask this rank's own daemon to rebuild the memory-only parts that lost daemons of its
        erasure-coded group held (``POST /v1/tiers/rebuild``; ``ckptd.server.parity``): they are
        then held there as replicas, and ``walk`` finds them. Best effort: a daemon without
        ``--ec`` rebuilds nothing."""
        try:
            got = ask_json(
                self.daemon_url, self._token, self.timeout_s, "POST", "/v1/tiers/rebuild", {"job_root": self.root_uri}
            )
        except (ValueError, CheckpointError) as e:
            log.info("restore: %s rebuilt no erasure-coded parts: %s", self.daemon_url, e)
            return
        if got.get("rebuilt"):
            log.info("restore: %s rebuilt %s memory-only parts of lost daemons", self.daemon_url, got["rebuilt"])

    def report(self, source: Store, step: int) -> None:
        """Record and log the bytes the restore of ``step`` read per tier; tell the daemon."""
        got = self.last = source.tier_bytes() if isinstance(source, TierSource) else {"local": 0, "peer": 0, "root": 0}
        log.info(
            "restored %s %d: %d bytes from this node's daemon, %d from peers, %d from the job root",
            "memory-only step" if isinstance(source, TierSource) and source.root is None else "step",
            step,
            got["local"],
            got["peer"],
            got["root"],
        )
        try:  # the daemon's ckptd_restore_bytes_*_total
            ask_json(self.daemon_url, self._token, self.timeout_s, "POST", "/v1/tiers/restored", got)
        except (ValueError, CheckpointError) as e:
            log.debug("restore: could not report tier bytes to the daemon: %s", e)

    def fence(self, step: int) -> None:
        """Tell this rank's own daemon that the root restored ``step`` (``POST
        /v1/tiers/restored``): it drops memory-only steps newer than it, and tells its peers to
        (signed: no rank fences a peer). Best effort: a daemon that is gone holds nothing."""
        body = {"job_root": self.root_uri, "restored_step": step, "silent": sorted(self.silent)[:256]}
        try:
            ask_json(self.daemon_url, self._token, self.timeout_s, "POST", "/v1/tiers/restored", body)
        except (ValueError, CheckpointError) as e:
            log.warning("restore: could not tell %s that step %d was restored: %s", self.daemon_url, step, e)
