"""Tiered restore reads: each shard range from the nearest tier that holds the committed step.

``TieredRestore(daemon_url, root_uri)`` is handed to ``restore_state``; for the committed step
(and attempt, from the commit record the manifest was written with) it asks this rank's daemon
and the peers that daemon names (``GET /v1/tiers/keys``) which shard objects they hold complete,
then reads every shard of the restore's plan (``layout.plan_reads``, unchanged: any world size)
from the first of: its own node's daemon, a peer daemon (ranged reads), the job root.

Trust: a tier is a cache, never a source of truth. Every chunk read from a tier is checked
against the crc32c stored with it, and every answer must carry the step and attempt of the
commit record (``X-Ckptd-Step`` / ``X-Ckptd-Attempt``) and exactly the bytes asked for. A tier
that is gone or slower than ``timeout_s`` is skipped for the rest of the restore; a shard that
fails any check is read again from the next tier, at last from the job root. So a tier can make
a restore slower, never make it fail or return other values than the job root holds.

Thread safety: ``TieredReader.read_shard`` runs on the restore's pool; tier state (dead or
alive) and the per-tier byte counts are guarded by a lock.
"""

from __future__ import annotations

import http.client
import json
import logging
import mmap
import os
import socket
import sys
import threading
from collections.abc import Sequence
from urllib.parse import quote, urlencode, urlsplit

import numpy as np

from ckptd.codec import CRC_BYTES, parse_inline
from ckptd.errors import CheckpointError
from ckptd.layout import plan_reads
from ckptd.reader import CheckpointReader, ReadRequest
from ckptd.tierwire import F_GET_SEALS, MAX_FDS, REPLY, REQUEST, SEALS, WireError, recv_exact, recv_frame, send_frame
from storage_backends import StorageError, Store
from storage_backends.base import as_writable_buffers
from trainer_hooks.daemon_client import _token

__all__ = ["DEFAULT_TIER_TIMEOUT_S", "TierStore", "TieredReader", "TieredRestore"]

log = logging.getLogger("ckptd.tiered")

DEFAULT_TIER_TIMEOUT_S = 10.0  # a peer slower than this per request is skipped (CKPTD_TIER_TIMEOUT_S)
MAX_KEYS_REPLY = 256 << 20
BATCH_BYTES = int(
    os.environ.get("CKPTD_TIER_BATCH_BYTES", 4 << 20)
)  # shard-object bytes one batched tier read asks for (at most one object more)


class TierUnavailable(Exception):  # noqa: N818 - not a StorageError: the reader must not turn it into a bad chunk
    """A tier did not answer, or answered something other than the committed bytes: the tier is
    skipped for the rest of the restore."""


class TierStore:
    """The read side of one daemon's memory tier for one (root, step, attempt), shaped like the
    ``Store`` methods ``CheckpointReader`` reads chunks with."""

    def __init__(self, url: str, name: str, root: str, step: int, attempt: str, token: str | None, timeout_s: float):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise CheckpointError(f"tier daemon must be an http://host:port URL, got {url!r}")
        self.url, self.name, self.uri = url.rstrip("/"), name, url
        self._cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._host, self._port, self._base = parts.hostname, parts.port, parts.path.rstrip("/")
        self.root, self.step, self.attempt = root, step, attempt
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._token = token
        self.timeout_s = timeout_s
        # The data path (``ckptd.server.tierdata``), as the keys reply advertises it: the TCP port
        # on this daemon's host, and the Unix socket when this is the rank's own node's daemon.
        self.data_port: int | None = None
        self.data_socket: str | None = None
        self.advertised = None  # the keys reply's "data"
        self._local = threading.local()
        self._conns: list = []  # every thread's connection, closed by close()
        self._conns_lock = threading.Lock()

    # Small objects are fetched in batches on either path: one request (HTTP or data path) per
    # batch costs less than one per object, even on the data path (measured: the tiers benchmark).
    batched = True

    def use_data(self, data, unix: bool) -> None:
        """Read through the advertised data path ``data`` ({"port", "socket"}); its Unix socket
        only when ``unix`` (this node's own daemon)."""
        if not isinstance(data, dict):
            return
        port, path = data.get("port"), data.get("socket")
        if type(port) is int and 0 < port < 65536:
            self.data_port = port
        if unix and isinstance(path, str) and os.path.isabs(path) and sys.platform.startswith("linux"):
            self.data_socket = path

    def close(self) -> None:
        """Close every thread's connection (a restore ends with its tiers)."""
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()

    def _conn(self) -> http.client.HTTPConnection:
        """This thread's connection to the tier (kept open across requests: one per pool thread)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._cls(self._host, self._port, timeout=self.timeout_s)
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    def _drop_conn(self, conn) -> None:
        conn.close()
        self._local.conn = None

    def _data_conn(self, unix: bool) -> socket.socket:
        """This thread's connection to the data path (kept open across requests)."""
        name = "dunix" if unix else "dtcp"
        sock = getattr(self._local, name, None)
        if sock is None:
            if unix:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(self.timeout_s)
                    sock.connect(self.data_socket)
                except OSError:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((self._host, self.data_port), timeout=self.timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            setattr(self._local, name, sock)
            with self._conns_lock:
                self._conns.append(sock)
        return sock

    def _data_call(self, header: dict, unix: bool, max_fds: int = 0) -> tuple[socket.socket, dict, list[int]]:
        """Send one request on the data path; return the connection and the checked reply header
        (and descriptors). Any failure drops the connection: TierUnavailable."""
        sock = None
        try:
            sock = self._data_conn(unix)
            req = {"token": self._token, "root": self.root, "step": self.step, "attempt": self.attempt, **header}
            send_frame(sock, REQUEST, req)
            got = recv_frame(sock, REPLY, max_fds)
            if got is None:
                raise WireError("the daemon closed the connection")
            reply, fds = got
        except (OSError, WireError) as e:
            if sock is not None:
                self._drop_data(unix)
            raise TierUnavailable(f"{self.name}: data path: {e or type(e).__name__}") from None
        if reply.get("ok") is not True or reply.get("step") != self.step or reply.get("attempt") != self.attempt:
            for fd in fds:
                os.close(fd)
            self._drop_data(unix)
            why = reply.get("detail") if reply.get("ok") is not True else "another step or attempt"
            raise TierUnavailable(f"{self.name}: data path answered {reply.get('status')}: {str(why)[:200]}")
        return sock, reply, fds

    def _drop_data(self, unix: bool) -> None:
        name = "dunix" if unix else "dtcp"
        sock = getattr(self._local, name, None)
        if sock is not None:
            sock.close()
            setattr(self._local, name, None)

    def _data_read(self, ranges: Sequence[tuple[str, int, int]], views: list[memoryview]) -> None:
        """The bytes of ``ranges``, concatenated, received straight into ``views`` (exactly as
        many bytes as they hold)."""
        unix = self.data_socket is not None
        length = sum(v.nbytes for v in views)
        sock, reply, _ = self._data_call({"op": "read", "ranges": [list(r) for r in ranges]}, unix)
        if reply.get("length") != length:
            self._drop_data(unix)
            raise TierUnavailable(f"{self.name}: {reply.get('length')} bytes where {length} were asked")
        try:
            for v in views:
                recv_exact(sock, v)
        except (OSError, WireError) as e:
            self._drop_data(unix)
            raise TierUnavailable(f"{self.name}: data path: {e or type(e).__name__}") from None

    def map_objects(self, keys: Sequence[str]) -> _Fetched:
        """Every object of ``keys`` mapped read-only from the sealed memory the daemon passes
        on its Unix data socket (``SCM_RIGHTS``): no byte crosses a socket. The descriptors must
        carry the seals (nobody can change the memory while this rank reads it); the chunks are
        still checked against their crc32c when read."""
        import fcntl

        mapped = _Fetched(f"{self.name} (shared memory)")
        keys = list(keys)
        try:
            for i in range(0, len(keys), MAX_FDS):
                part = keys[i : i + MAX_FDS]
                _, reply, fds = self._data_call({"op": "fds", "keys": part}, True, max_fds=len(part))
                try:
                    sizes = reply.get("sizes")
                    if not isinstance(sizes, list) or len(sizes) != len(part) or len(fds) != len(part):
                        raise TierUnavailable(f"{self.name}: {len(fds)} descriptors for {len(part)} objects")
                    for key, size, fd in zip(part, sizes, fds, strict=True):
                        if type(size) is not int or size <= 0 or os.fstat(fd).st_size != size:
                            raise TierUnavailable(f"{self.name}: {key}: descriptor of another size than {size}")
                        if fcntl.fcntl(fd, F_GET_SEALS) & SEALS != SEALS:
                            raise TierUnavailable(f"{self.name}: {key}: memory not sealed against writes")
                        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                        mapped.held[key] = (0, memoryview(m))
                finally:
                    for fd in fds:
                        os.close(fd)
        except OSError as e:
            mapped.close()
            raise TierUnavailable(f"{self.name}: cannot map the shared copy: {e}") from None
        except BaseException:
            mapped.close()
            raise
        return mapped

    def _open(self, path: str, cap: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, int]:
        """Send a GET; return the response with its body unread and its Content-Length (at
        most ``cap``)."""
        conn = self._conn()
        try:
            conn.request("GET", self._base + path, headers=self._headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            self._drop_conn(conn)
            raise TierUnavailable(f"{self.name}: {e or type(e).__name__}") from None
        length = resp.getheader("Content-Length")
        if length is None or not length.isdigit() or int(length) > cap:
            self._drop_conn(conn)
            raise TierUnavailable(f"{self.name}: reply of {length} bytes where at most {cap} were asked")
        return conn, resp, int(length)

    def _get(self, path: str, cap: int) -> tuple[int, dict, bytes]:
        conn, resp, _ = self._open(path, cap)
        try:
            return resp.status, dict(resp.getheaders()), resp.read()
        except (OSError, http.client.HTTPException) as e:
            self._drop_conn(conn)
            raise TierUnavailable(f"{self.name}: {e or type(e).__name__}") from None

    def keys(self) -> tuple[set[str], list[str]]:
        """(the objects this tier holds complete for the step, the peers it names)."""
        q = urlencode({"root": self.root, "step": self.step, "attempt": self.attempt})
        status, _, raw = self._get(f"/v1/tiers/keys?{q}", MAX_KEYS_REPLY)
        if status != 200:
            raise TierUnavailable(f"{self.name}: GET /v1/tiers/keys answered {status}")
        try:
            body = json.loads(raw)
            keys = {k for k in body["keys"] if isinstance(k, str)}
            peers = [p for p in body.get("peers", []) if isinstance(p, str)]
            self.advertised = body.get("data")
        except (ValueError, KeyError, TypeError) as e:
            raise TierUnavailable(f"{self.name}: malformed keys reply ({e})") from None
        if body.get("step") != self.step or body.get("attempt") != self.attempt:
            raise TierUnavailable(f"{self.name}: keys reply is for another step or attempt")
        return keys, peers

    def _object_path(self, key: str, start: int, length: int) -> str:
        q = f"root={quote(self.root, safe='')}&step={self.step}&attempt={quote(self.attempt, safe='')}"
        return f"/v1/tiers/object?{q}&key={quote(key, safe='')}&start={start}&length={length}"

    def _check_reply(self, key: str, resp: http.client.HTTPResponse, got: int, length: int) -> None:
        if resp.status != 200:
            raise TierUnavailable(f"{self.name}: {key} answered {resp.status}")
        if resp.getheader("X-Ckptd-Step") != str(self.step) or resp.getheader("X-Ckptd-Attempt") != self.attempt:
            raise TierUnavailable(f"{self.name}: {key} came from another step or attempt than the commit record's")
        if got != length:
            raise TierUnavailable(f"{self.name}: {key}: {got} bytes where {length} were asked")

    def get_range(self, key: str, start: int, length: int) -> bytes:
        buf = bytearray(length)
        self.get_range_into(key, start, [buf])
        return bytes(buf)

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return [self.get_range(key, s, n) for s, n in ranges]

    def get_range_into(self, key: str, start: int, buffers) -> None:
        """One GET (or one data-path request) for the whole range, its body read straight into
        ``buffers`` (no intermediate copy); the connection stays open for this thread's next read."""
        views = as_writable_buffers(buffers)
        length = sum(v.nbytes for v in views)
        if self.data_port is not None or self.data_socket is not None:
            self._data_read([(key, start, length)], views)
            return
        conn, resp, got = self._open(self._object_path(key, start, length), length)
        try:
            self._check_reply(key, resp, got, length)  # on failure the connection is dropped unread
            for v in views:
                pos = 0
                while pos < v.nbytes:
                    n = resp.readinto(v[pos:])
                    if not n:
                        raise TierUnavailable(f"{self.name}: {key}: the reply ended early")
                    pos += n
        except TierUnavailable:
            self._drop_conn(conn)
            raise
        except (OSError, http.client.HTTPException) as e:
            self._drop_conn(conn)
            raise TierUnavailable(f"{self.name}: {e or type(e).__name__}") from None

    def get_batch(self, ranges: Sequence[tuple[str, int, int]]) -> bytearray:
        """The bytes of ``ranges`` ((key, start, length) each), concatenated: one POST
        ``/v1/tiers/read``, its body read straight into one buffer."""
        length = sum(n for _, _, n in ranges)
        if self.data_port is not None or self.data_socket is not None:
            out = bytearray(length)
            self._data_read(ranges, [memoryview(out)])
            return out
        body = {
            "root": self.root,
            "step": self.step,
            "attempt": self.attempt,
            "ranges": [{"key": k, "start": st, "length": n} for k, st, n in ranges],
        }
        conn = self._conn()
        try:
            headers = {**self._headers, "Content-Type": "application/json"}
            conn.request("POST", self._base + "/v1/tiers/read", body=json.dumps(body).encode(), headers=headers)
            resp = conn.getresponse()
            got = resp.getheader("Content-Length")
            got_n = int(got) if got is not None and got.isdigit() else -1
            self._check_reply(f"a batch of {len(ranges)} ranges", resp, got_n, length)
            out = bytearray(length)
            view, pos = memoryview(out), 0
            while pos < length:
                n = resp.readinto(view[pos:])
                if not n:
                    raise TierUnavailable(f"{self.name}: a batch reply ended early")
                pos += n
            return out
        except TierUnavailable:
            self._drop_conn(conn)
            raise
        except (OSError, http.client.HTTPException) as e:
            self._drop_conn(conn)
            raise TierUnavailable(f"{self.name}: {e or type(e).__name__}") from None


class _Fetched:
    """Ranges of shard objects already fetched from one tier (``TieredReader.read``), shaped
    like the ``Store`` methods ``CheckpointReader`` reads chunks with; a range it does not hold
    is ``TierUnavailable`` (the shard is then read from the next tier)."""

    batched = False  # the bytes are here: nothing to batch

    def __init__(self, name: str):
        self.name = name
        self.held: dict[str, tuple[int, memoryview]] = {}

    def close(self) -> None:
        """Forget the held views (a mapping is unmapped once no tensor copy reads from it)."""
        self.held = {}

    def _view(self, key: str, start: int, length: int) -> memoryview:
        begin, mv = self.held.get(key, (0, None))
        if start < 0 and begin == 0 and mv is not None:
            start += len(mv)  # from the end of a whole object (a shard index)
        if mv is None or start < begin or start + length > begin + len(mv):
            raise TierUnavailable(f"{self.name}: {key} {start}+{length} was not fetched")
        return mv[start - begin : start - begin + length]

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return bytes(self._view(key, start, length))

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return [self.get_range(key, s, n) for s, n in ranges]

    def get_range_into(self, key: str, start: int, buffers) -> None:
        views = as_writable_buffers(buffers)
        data = np.frombuffer(self._view(key, start, sum(v.nbytes for v in views)), np.uint8)
        pos = 0
        for v in views:
            np.frombuffer(v, np.uint8)[:] = data[pos : pos + v.nbytes]  # numpy copies without the GIL
            pos += v.nbytes


class _Tier:
    def __init__(self, store: TierStore, kind: str, prefix: str):
        self.store, self.kind, self.prefix = store, kind, prefix
        self.dead = False

    def reader(self, pins=None) -> CheckpointReader:
        """A reader of this tier for one shard: its byte count is the shard's alone; every chunk
        is checked against ``pins`` (the committing attempt's, ``ckptd.pins``) where given."""
        return CheckpointReader(self.store, self.prefix, where=f"{self.store.name} (memory tier)", pins=pins)  # type: ignore[arg-type]


class TieredReader(CheckpointReader):
    """A ``CheckpointReader`` of the job root that reads each shard from the first tier holding
    it (``holders``: object key -> tiers, nearest first) and falls back to the root."""

    def __init__(self, store: Store, prefix: str, holders: dict[str, list[_Tier]]):
        super().__init__(store, prefix)
        self._holders = holders
        self._tlock = threading.Lock()
        self._bytes = {"local": 0, "peer": 0}  # bytes of the shards each tier kind served
        self.skipped = 0  # shard reads a tier failed and a later tier (or the root) served

    def close(self) -> None:
        """Close the tiers' connections (the restore is over, read or failed)."""
        for store in {id(t.store): t.store for tiers in self._holders.values() for t in tiers}.values():
            store.close()

    def read(self, requests, pool=None) -> None:
        """Fill every request's ``out``. The shard objects a live tier holds (the ranges of them
        this rank reads, when under ``BATCH_BYTES``; larger ones are read as one GET per range,
        straight into the tensors) are fetched in batches (one POST ``/v1/tiers/read`` per
        ``BATCH_BYTES`` of one tier, each batch on the pool with the reads of its shards: the
        per-request cost of HTTP is paid per batch, and at most a pool's worth of batches is in
        memory); every chunk is then checked as any read's. A batch that fails marks its tier
        dead and leaves its shards to the per-shard path (the next tier, at last the job root)."""
        tasks = []
        for req in requests:
            if req.out.shape != req.want.shape:
                raise CheckpointError(f"{req.entry.key}: output shape {req.out.shape} != wanted {req.want.shape}")
            if req.entry.value is not None:
                req.out[...] = parse_inline(req.entry.value)
                continue
            tasks.extend((req, sr) for sr in plan_reads(req.entry.layout, req.want))
        by_key: dict[str, list] = {}  # key -> [tier, lo, hi, tasks]
        plain = []
        for req, sr in tasks:
            key = self._object(req.entry, sr.shard)
            tier = next((t for t in self._holders.get(key, ()) if not t.dead), None)
            if tier is None or not BATCH_BYTES or not tier.store.batched:
                plain.append((req, sr))
                continue
            layout = req.entry.layout
            n = layout.chunk_nbytes + CRC_BYTES
            spans = self._computed_spans(layout, sr) if layout.sharded else [(0, n, ())]
            lo, hi = min(o for o, _, _ in spans), max(o + m for o, m, _ in spans)
            got = by_key.setdefault(key, [tier, lo, hi, []])
            got[1], got[2] = min(got[1], lo), max(got[2], hi)
            got[3].append((req, sr))
        for key in [k for k, v in by_key.items() if v[2] - v[1] > BATCH_BYTES]:
            # A large range gains nothing from batching and would be held whole in a buffer:
            # its shards stream straight into the caller's tensors (one GET per coalesced range).
            plain += by_key.pop(key)[3]
        batches: list[tuple[_Tier, list[str]]] = []
        open_batch: dict[int, tuple[list[str], list[int]]] = {}
        for key, (tier, lo, hi, _) in by_key.items():
            keys, size = open_batch.setdefault(id(tier), ([], [0]))
            if keys and size[0] + hi - lo > BATCH_BYTES:
                batches.append((tier, keys))
                keys, size = open_batch[id(tier)] = ([], [0])
            keys.append(key)
            size[0] += hi - lo
        for key_list, _ in open_batch.values():
            if key_list:
                batches.append((by_key[key_list[0]][0], key_list))

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
                    self._tier_failed(tier, e)
            for k in keys:
                for req, sr in by_key[k][3]:
                    self._read_one(req, sr, (tier, fetched) if fetched is not None else None)

        jobs = [(run_batch, (t, ks)) for t, ks in batches] + [(self._read_one, (r, sr, None)) for r, sr in plain]
        if pool is None:
            for fn, args in jobs:
                fn(*args)
            return
        futures = [pool.submit(fn, *args) for fn, args in jobs]
        errors = []
        for f in futures:
            try:
                f.result()
            except CheckpointError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _tier_failed(self, tier: _Tier, e: Exception) -> None:
        with self._tlock:
            self.skipped += 1
            first = not tier.dead
            tier.dead = True
        if first:
            log.warning("restore: skipping the memory tier %s: %s", tier.store.name, e)

    def read_shard(self, req: ReadRequest, sr) -> None:
        self._read_one(req, sr, None)

    def _read_one(self, req: ReadRequest, sr, fetched) -> None:
        """Read one shard: from the bytes a batch already fetched (``fetched``: (tier, _Fetched)),
        else (or when those fail a check) from the first other live tier holding it, else from
        the job root."""
        source = None  # the tier whose fetched bytes failed: not asked again for this shard
        if fetched is not None:
            tier, store = fetched
            reader = CheckpointReader(store, tier.prefix, where=f"{tier.store.name} (memory tier)", pins=self.pins)  # type: ignore[arg-type]
            try:
                reader.read_shard(req, sr)  # every chunk checked against its crc32c
                with self._tlock:
                    self._bytes[tier.kind] += reader.stats.bytes_read
                return
            except (TierUnavailable, CheckpointError, StorageError) as e:  # a bad chunk, or not fetched
                with self._tlock:
                    self.skipped += 1
                log.warning("restore: %s; reading that shard from the next tier", e)
                source = tier
        for tier in self._holders.get(self._object(req.entry, sr.shard), ()):
            if tier.dead or tier is source:
                continue
            reader = tier.reader(self.pins)
            try:
                reader.read_shard(req, sr)  # every chunk checked against its crc32c
                with self._tlock:
                    self._bytes[tier.kind] += reader.stats.bytes_read
                return
            except TierUnavailable as e:
                self._tier_failed(tier, e)
            except (CheckpointError, StorageError) as e:  # a bad chunk: this shard from the next tier
                with self._tlock:
                    self.skipped += 1
                log.warning("restore: %s; reading that shard from the next tier", e)
        super().read_shard(req, sr)  # the job root: the chunks the plan reads, checked the same way

    def tier_bytes(self) -> dict[str, int]:
        """Chunk bytes each tier served: ``local`` (own daemon), ``peer``, ``root``; bytes a tier
        sent that failed a check count for none (the tier that then served the shard counts)."""
        with self._tlock:
            return {**self._bytes, "root": self.stats.bytes_read}


class TieredRestore:
    """Builds the ``TieredReader`` of each restore and keeps what the last one read per tier."""

    def __init__(self, daemon_url: str, root_uri: str, timeout_s: float | None = None):
        self.daemon_url = daemon_url.rstrip("/")
        self.root_uri = root_uri
        env = os.environ.get("CKPTD_TIER_TIMEOUT_S")
        self.timeout_s = timeout_s if timeout_s is not None else float(env) if env else DEFAULT_TIER_TIMEOUT_S
        self.last: dict[str, int] = {}
        self._token = _token()

    def reader(self, store: Store, prefix: str, step: int, attempt: str, coord=None) -> TieredReader:
        """The reader of committed ``step`` (whose commit record names ``attempt``). Collective
        when ``coord`` is given (every rank calls it once; it never raises): each rank asks its
        own daemon what it holds, rank 0 alone asks the peers its daemon names and broadcasts
        their answers (one request per peer per restore, not per rank). A tier that cannot say
        what it holds is left out; with none, every shard comes from the root."""
        holders: dict[str, list[_Tier]] = {}
        peers: list[str] = []
        own = None
        try:
            own = TierStore(
                self.daemon_url, f"daemon {self.daemon_url}", self.root_uri, step, attempt, self._token, self.timeout_s
            )
            keys, peers = own.keys()
            own.use_data(own.advertised, unix=True)
            local = _Tier(own, "local", prefix)
            if keys and own.data_socket is not None and os.environ.get("CKPTD_TIER_SHARED_MEMORY", "1") != "0":
                try:  # the node's own daemon: its sealed memory mapped, no byte over a socket
                    local = _Tier(own.map_objects(sorted(keys)), "local", prefix)
                except TierUnavailable as e:
                    log.info("restore: reading this node's tier copy over its socket: %s", e)
                    own.data_socket = None
                own.close()
            for k in keys:
                holders.setdefault(k, []).append(local)
            if not keys:
                own.close()  # nothing to read from it
        except Exception as e:  # noqa: BLE001 - a tier never fails a restore (and rank 0 must reach the broadcast)
            log.warning("restore: this node's daemon holds no tier copy: %s", e)
            if own is not None:
                own.close()
        held: dict[str, dict] = {}
        if coord is None or coord.rank == 0:
            held = self._ask_peers(peers, step, attempt)
        if coord is not None:
            held = coord.broadcast(held)
        for url, info in sorted(held.items()):
            if url.rstrip("/") == self.daemon_url:
                continue  # this rank's own daemon: asked above, read as the nearest tier
            peer = TierStore(url, f"peer {url}", self.root_uri, step, attempt, self._token, self.timeout_s)
            peer.use_data(info.get("data"), unix=False)
            tier = _Tier(peer, "peer", prefix)
            for k in info.get("keys", ()):
                holders.setdefault(k, []).append(tier)
        return TieredReader(store, prefix, holders)

    def _ask_peers(self, peers: list[str], step: int, attempt: str) -> dict[str, dict]:
        """peer URL -> {"keys": the objects it holds complete for (step, attempt), "data": its
        advertised data path}; peers that do not answer are left out (logged)."""
        held: dict[str, dict] = {}
        for url in peers:
            url = url.rstrip("/")
            if url == self.daemon_url or url in held:
                continue
            peer = None
            try:
                peer = TierStore(url, f"peer {url}", self.root_uri, step, attempt, self._token, self.timeout_s)
                keys, _ = peer.keys()
            except Exception as e:  # noqa: BLE001 - a peer never fails a restore
                log.warning("restore: skipping the memory tier of peer %s: %s", url, e)
                continue
            finally:
                if peer is not None:
                    peer.close()
            if keys:
                held[url] = {"keys": sorted(keys), "data": peer.advertised}
        return held

    def report(self, reader: TieredReader) -> dict[str, int]:
        """Record and log the bytes the restore read per tier; tell the daemon (``/metrics``)."""
        self.last = reader.tier_bytes()
        log.info(
            "restore read %d bytes from this node's daemon, %d from peers, %d from the job root",
            self.last["local"],
            self.last["peer"],
            self.last["root"],
        )
        own = TierStore(self.daemon_url, "daemon", self.root_uri, 0, "", self._token, self.timeout_s)
        try:
            conn = own._cls(own._host, own._port, timeout=self.timeout_s)
            body = json.dumps(self.last).encode()
            headers = {**own._headers, "Content-Type": "application/json"}
            conn.request("POST", own._base + "/v1/tiers/restored", body=body, headers=headers)
            conn.getresponse().read()
            conn.close()
        except (OSError, http.client.HTTPException) as e:
            log.debug("restore: could not report tier bytes to the daemon: %s", e)
        return self.last
