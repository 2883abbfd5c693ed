"""Reading a memory-only step from the daemons that hold its parts (``trainer_hooks.memsteps``):
``_Daemon`` asks one daemon which parts of a root it holds (``GET /v1/tiers?keys=true``), and
``TierPartsStore`` is the read-only ``Store`` of one (step, attempt) over those daemons that
the one restore path reads through.

Trust: the daemons are caches, never a source of truth. Every read goes through the memory
tier's own client (``trainer_hooks.tierstore.TierStore``), which refuses an answer for another
step or attempt or of other than the asked length; chunks are then checked against their
crc32c and the writers' pins by the reader, the manifest against the sha256 rank 0 computed.
A daemon that fails is skipped for the rest of the restore; an object no live daemon serves is
a StorageError, and the caller falls back to the persisted step.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
from collections.abc import Iterator
from urllib.parse import urlencode, urlsplit

from ckptd import manifest as mf
from ckptd.errors import CheckpointError
from storage_backends import NotFoundError, StorageError, Store
from storage_backends.base import ObjectInfo, as_writable_buffers, check_limit, resolve_range
from trainer_hooks.tierstore import TierStore, TierUnavailable

__all__ = ["MAX_LIST_REPLY", "TierPartsStore"]

log = logging.getLogger("ckptd.memsteps")

MAX_LIST_REPLY = 64 << 20


class _Daemon:
    """GETs of one daemon's memory-only routes (a connection per call: a restore asks little)."""

    def __init__(self, url: str, token: str | None, timeout_s: float):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise CheckpointError(f"tier daemon must be an http://host:port URL, got {url!r}")
        self.url = url.rstrip("/")
        self._cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._host, self._port, self._base = parts.hostname, parts.port, parts.path.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s = timeout_s

    def request(self, method: str, path: str, body: bytes | None = None, cap: int = MAX_LIST_REPLY):
        """(status, headers, body) or OSError / HTTPException."""
        conn = self._cls(self._host, self._port, timeout=self.timeout_s)
        try:
            headers = dict(self._headers)
            if body is not None:
                headers["Content-Type"] = "application/json"
            conn.request(method, self._base + path, body=body, headers=headers)
            resp = conn.getresponse()
            length = resp.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > cap:
                raise OSError(f"{self.url}: reply of {length} bytes where at most {cap} were expected")
            raw = resp.read(cap + 1)
            if len(raw) > cap:
                raise OSError(f"{self.url}: reply over {cap} bytes")
            return resp.status, resp, raw
        finally:
            conn.close()

    def parts(self, root: str) -> tuple[list[dict], list[str], dict | None]:
        status, _, raw = self.request("GET", "/v1/tiers?" + urlencode({"root": root, "keys": "true"}))
        if status != 200:
            raise OSError(f"{self.url}: GET /v1/tiers answered {status}")
        body = json.loads(raw)
        if not isinstance(body, dict) or not isinstance(body.get("memory_only"), list):
            raise ValueError(f"{self.url}: malformed tiers listing")
        data = body.get("data") if isinstance(body.get("data"), dict) else None
        return body["memory_only"], [p for p in body.get("peers", []) if isinstance(p, str)], data


class TierPartsStore(Store):
    """A read-only store of one memory-only (step, attempt) over the daemons that hold its parts:
    ``holders`` maps each object key to (size, daemon URLs, nearest first), ``data`` each URL to
    the data path it advertised. Reads go through the memory tier's own client
    (``trainer_hooks.tierstore.TierStore``: the data path, one kept-open connection per thread and
    daemon; ``map_own``: the rank's own daemon's sealed memory mapped, no byte over a socket).
    A daemon that fails or answers other than exactly the asked bytes of that step and attempt is
    skipped for the rest of the restore; an object no live daemon serves is a StorageError (the
    restore then fails on every rank, and the job falls back to the persisted step). The chunks
    are checked by the reader as any read's (crc32c, the writers' pins). ``commit``: the record
    the commit would have written, served as the step's ``commit.json``."""

    def __init__(self, root_uri, step, attempt, holders, commit, token, timeout_s, own=None, data=None):
        self.uri = f"{root_uri.rstrip('/')} [memory tiers]"
        self.root = root_uri
        self.step, self.attempt = step, attempt
        self.holders: dict[str, tuple[int, list[str]]] = holders
        self.commit = commit
        self._commit_key = f"{mf.step_dir(step)}/{mf.COMMIT}"
        self._token, self._timeout = token, timeout_s
        self.own = own.rstrip("/") if own else None
        self._data: dict = data or {}
        self._lock = threading.Lock()
        self._dead: set[str] = set()
        self._tiers: dict[str, TierStore] = {}
        self._mapped = None  # the own daemon's objects, mapped (``map_own``)
        self.bytes = {"local": 0, "peer": 0, "root": 0}

    def _tier(self, url: str) -> TierStore:
        with self._lock:
            t = self._tiers.get(url)
            if t is None:
                name = f"{'daemon' if url == self.own else 'peer'} {url}"
                t = TierStore(url, name, self.root, self.step, self.attempt, self._token, self._timeout)
                t.use_data(self._data.get(url), unix=url == self.own)
                self._tiers[url] = t
            return t

    def map_own(self) -> None:
        """Map every object the rank's own daemon holds from the sealed memory it passes on its
        Unix data socket (as ``trainer_hooks.tiered`` does for a hot copy); where that fails the
        objects are read over the data path."""
        if self.own is None or os.environ.get("CKPTD_TIER_SHARED_MEMORY", "1") == "0":
            return
        keys = sorted(k for k, (size, urls) in self.holders.items() if size > 0 and self.own in urls)
        tier = self._tier(self.own)
        if not keys or tier.data_socket is None:
            return
        try:
            self._mapped = tier.map_objects(keys)
        except TierUnavailable as e:
            log.info("restore: reading this node's memory-only parts over its socket: %s", e)
            tier.data_socket = None
        tier.close()

    def close(self) -> None:
        """Close every daemon's connections and forget the mapped objects (the restore is over)."""
        with self._lock:
            tiers, self._tiers = list(self._tiers.values()), {}
        for t in tiers:
            t.close()
        if self._mapped is not None:
            self._mapped.close()

    def _size(self, key: str) -> int:
        if key == self._commit_key and self.commit is not None:
            return len(mf.dumps(self.commit))
        got = self.holders.get(key)
        if got is None:
            raise NotFoundError(f"{self.uri}: no object {key!r}")
        return got[0]

    def get(self, key: str, limit: int | None = None) -> bytes:
        if key == self._commit_key and self.commit is not None:
            return mf.dumps(self.commit)
        size = self._size(key)
        check_limit(self.uri, key, size, limit)
        return self.get_range(key, 0, size)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        buf = bytearray(length)
        self.get_range_into(key, start, [buf])
        return bytes(buf)

    def get_range_into(self, key: str, start: int, buffers) -> None:
        views = as_writable_buffers(buffers)
        length = sum(v.nbytes for v in views)
        size = self._size(key)
        begin = resolve_range(self.uri, key, start, length, size)
        if key == self._commit_key and self.commit is not None:
            _fill(views, memoryview(mf.dumps(self.commit))[begin : begin + length])
            return
        errors = []
        for url in self.holders[key][1]:
            with self._lock:
                if url in self._dead:
                    continue
            try:
                mapped = self._mapped if url == self.own else None
                if mapped is not None and key in mapped.held:
                    mapped.get_range_into(key, begin, views)
                else:
                    self._tier(url).get_range_into(key, begin, views)
            except (TierUnavailable, CheckpointError) as e:  # gone, slow, wrong answer, or a bad URL
                errors.append(f"{url}: {e}")
                with self._lock:
                    self._dead.add(url)
                log.warning("restore: skipping the memory tier of %s: %s", url, e)
                continue
            with self._lock:
                self.bytes["local" if url == self.own else "peer"] += length
            return
        raise StorageError(f"{self.uri}: no live daemon serves {key!r} ({'; '.join(errors) or 'all skipped'})")

    def put(self, key, data) -> None:
        raise StorageError(f"{self.uri}: read-only")

    def put_if_absent(self, key, data) -> bool:
        raise StorageError(f"{self.uri}: read-only")

    def delete(self, key) -> None:
        raise StorageError(f"{self.uri}: read-only")

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        keys = set(self.holders) | ({self._commit_key} if self.commit is not None else set())
        for k in sorted(keys):
            if k.startswith(prefix):
                yield ObjectInfo(k, self._size(k), 0.0)

    def list_dir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        files, dirs = [], set()
        for info in self.list(prefix):
            rest = info.key[len(prefix) :]
            if "/" in rest:
                dirs.add(rest.split("/", 1)[0])
            else:
                files.append(rest)
        return files, sorted(dirs)


def _fill(views: list[memoryview], data: memoryview) -> None:
    pos = 0
    for v in views:
        v[:] = data[pos : pos + v.nbytes]
        pos += v.nbytes
