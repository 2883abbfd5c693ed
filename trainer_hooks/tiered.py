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

import logging
import os
import threading

from ckptd.auth import daemon_token
from ckptd.codec import CRC_BYTES, parse_inline
from ckptd.errors import CheckpointError
from ckptd.layout import plan_reads
from ckptd.reader import CheckpointReader, ReadRequest
from storage_backends import StorageError, Store
from trainer_hooks.tierstore import BATCH_BYTES, DEFAULT_TIER_TIMEOUT_S, TierStore, TierUnavailable, _Fetched, ask

__all__ = ["DEFAULT_TIER_TIMEOUT_S", "TierStore", "TieredReader", "TieredRestore"]

log = logging.getLogger("ckptd.tiered")


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
        self._token = daemon_token()

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
            try:
                peer = TierStore(url, f"peer {url}", self.root_uri, step, attempt, self._token, self.timeout_s)
            except CheckpointError as e:  # an address it cannot use: a tier never fails a restore
                log.warning("restore: skipping the memory tier of peer %s: %s", url, e)
                continue
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
        try:
            ask(self.daemon_url, self._token, self.timeout_s, "POST", "/v1/tiers/restored", self.last)
        except CheckpointError as e:
            log.debug("restore: could not report tier bytes to the daemon: %s", e)
        return self.last
