"""Peer discovery for the memory tier (``ckptd serve --discover``): the ring of node daemons read
from small records under the served job root, and a challenge that keeps the daemon token from
any URL a record merely names. docs/security.md ("Peer discovery") gives the threat model: the
challenge, why a relay fails, and the checks on records, which are hostile input.

Records: each daemon writes ``_daemons/<id>.json`` under every root it serves (``id``: 32 random
hex digits per process; ``{"format": 1, "daemon": id, "advertise": URL, "heartbeat": ms since
the epoch, "version": ckptd's}``), re-puts it every ``discover_interval_s`` and deletes it at a
clean shutdown. A root's ring is this daemon's ``--advertise`` URL and those of the records whose
storage time (clamped to now: ``leases.clamp``) is at most ``discover_ttl_s`` old, deduplicated
and sorted. A record is read once per (name, size): ``heartbeat`` has a fixed width, so a live
daemon's record keeps its size and renewals cost one LIST per root, not a GET per peer.

The token goes to a discovered peer only on a connection where it answered ``GET
/v1/tiers/hello?nonce=N`` (sent without the token) with ``hello_mac``: HMAC-SHA256 of the nonce
and the URL dialed, keyed by the peer key (``--peer-key-file``, which trainers never hold: a
trainer's server cannot pass it), or by the token where no peer key is set. Explicit ``--peers``
are trusted without a challenge; the peers named to restoring ranks are discovered daemons that
passed it within ``discover_ttl_s``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from itertools import islice
from urllib.parse import urlsplit

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from ckptd import __version__
from ckptd import manifest as mf
from ckptd.daemon_conn import DaemonConnection
from ckptd.errors import CheckpointError
from ckptd.leases import clamp
from ckptd.server.roots import Roots
from ckptd.server.settings import Settings
from ckptd.server.tiers import replica_targets
from storage_backends import NotFoundError, StorageError, Store

__all__ = [
    "DIR",
    "HELLO_PATH",
    "MAX_RECORDS",
    "MAX_RECORD_BYTES",
    "Discovery",
    "NotVerified",
    "hello_mac",
    "parse_record",
    "peer_url",
    "router",
]

log = logging.getLogger("ckptd.discovery")

DIR = mf.DAEMONS  # <job root>/_daemons/<id>.json
FORMAT = 1
MAX_RECORD_BYTES = 2048
MAX_RECORDS = 1024  # listing entries considered per root
MAX_URL = 512
NONCE_BYTES = 32
MAX_HELLO_REPLY = 1024
HELLO_PATH = "/v1/tiers/hello"
_CONTEXT = b"ckptd-tiers-hello\0"
_ID = re.compile(r"[0-9a-f]{32}", re.ASCII)
_NAME = re.compile(r"([0-9a-f]{32})\.json", re.ASCII)
_FIELDS = {"format", "daemon", "advertise", "heartbeat", "version"}


class NotVerified(Exception):
    """A discovered peer did not prove that it holds the daemon token for the URL dialed."""


def peer_url(url: object) -> str:
    """``url`` as a peer's URL (``http(s)://host[:port][/path]``, no trailing ``/``); ValueError
    for anything else."""
    if not isinstance(url, str) or not 0 < len(url) <= MAX_URL or not url.isascii() or not url.isprintable():
        raise ValueError("not a short printable ASCII URL")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as e:
        raise ValueError(f"not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("not an http(s)://host URL")
    if "@" in parts.netloc or parts.query or parts.fragment or " " in url:
        raise ValueError("a peer URL has no user, query or fragment")
    return url.rstrip("/")


def hello_mac(token: str, nonce: bytes, url: str) -> str:
    """The challenge answer of the daemon at ``url`` (its own --advertise) for ``nonce``."""
    msg = _CONTEXT + nonce + url.rstrip("/").encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def parse_record(raw: bytes, name_id: str) -> str:
    """The advertise URL of a daemon record named ``<name_id>.json``; ValueError when it is not
    exactly the schema."""
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError("not JSON") from None
    if not isinstance(rec, dict) or set(rec) != _FIELDS:
        raise ValueError(f"fields must be exactly {sorted(_FIELDS)}")
    if rec["format"] != FORMAT or type(rec["format"]) is not int:
        raise ValueError(f"format must be {FORMAT}")
    if not isinstance(rec["daemon"], str) or not _ID.fullmatch(rec["daemon"]) or rec["daemon"] != name_id:
        raise ValueError("daemon must be the 32 hex digits of its name")
    if type(rec["heartbeat"]) is not int or rec["heartbeat"] < 0:
        raise ValueError("heartbeat must be a non-negative integer")
    if not isinstance(rec["version"], str) or len(rec["version"]) > 64:
        raise ValueError("version must be a short string")
    return peer_url(rec["advertise"])


def record_bytes(daemon_id: str, me: str) -> bytes:
    # heartbeat: milliseconds, 13 digits until the year 2286: the record's size stays the same
    rec = {"format": FORMAT, "daemon": daemon_id, "advertise": me, "heartbeat": int(time.time() * 1000)}
    return json.dumps({**rec, "version": __version__}, sort_keys=True).encode()


def challenge(conn: DaemonConnection, url: str, token: str) -> None:
    """Ask the daemon at ``url`` (over ``conn``, which sends no token yet) to prove that it holds
    ``token`` and is the daemon of that URL; NotVerified when it does not."""
    nonce = os.urandom(NONCE_BYTES)
    try:
        status, _, raw = conn.fetch("GET", f"{HELLO_PATH}?nonce={nonce.hex()}", cap=MAX_HELLO_REPLY)
    except CheckpointError as e:
        raise NotVerified(f"{url}: no answer to the challenge ({e})") from None
    if status != 200:
        raise NotVerified(f"{url}: the challenge was answered with HTTP {status}: not a ckptd daemon of this job")
    try:
        mac = json.loads(raw)["mac"]
    except (ValueError, KeyError, TypeError):
        raise NotVerified(f"{url}: malformed challenge answer") from None
    if not isinstance(mac, str) or not hmac.compare_digest(mac.encode(), hello_mac(token, nonce, url).encode()):
        raise NotVerified(f"{url}: wrong challenge answer: not a daemon holding the token at this URL")


class Discovery:
    """The records of this daemon and the rings of its served roots (one thread renews both)."""

    def __init__(self, store_of: Callable[[str], Store], roots: Roots, settings: Settings, token: str):
        self.store_of = store_of
        self._served, self.roots = roots, list(roots.uris)
        self.me = peer_url(settings.advertise or "")
        self.token = token
        self.interval_s = settings.discover_interval_s
        self.ttl_s = settings.discover_ttl_s
        self.timeout_s = min(settings.replica_timeout_s, 10.0)  # of a challenge
        self.id = uuid.uuid4().hex
        self.key = f"{DIR}/{self.id}.json"
        self._lock = threading.Lock()
        self._listing = threading.Lock()
        self._seen: dict[str, dict[str, tuple[int, str | None]]] = {}  # root -> key -> (size, url or None)
        self._verified: dict[str, float] = {}  # url -> monotonic time of its last passed challenge
        self._failed: dict[str, float] = {}  # url -> monotonic time of its last failed challenge
        self._rings: dict[str, list[str]] = {}
        self.unreachable: dict[str, dict] = {}  # url -> {time, error} of its last failed challenge (``Tiers``')
        self._beat_failed: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_refresh: Callable[[list[str], list[str]], None] | None = None  # (peers, targets)
        self.replicas = settings.replicas

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ckptd-discovery", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop renewing and delete this daemon's records (a clean shutdown)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + self.interval_s)
        for root in self.roots:
            try:
                self.store_of(root).delete(self.key)
            except (StorageError, OSError) as e:
                log.warning("discovery: cannot delete %s/%s: %s", root, self.key, e)

    def _run(self) -> None:
        while True:
            self.beat()
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - discovery must never stop the daemon
                log.exception("discovery: refresh failed")
            if self._stop.wait(self.interval_s):
                return

    def beat(self) -> None:
        """Put this daemon's record in every served root."""
        for root in self.roots:
            try:
                self.store_of(root).put(self.key, record_bytes(self.id, self.me))
            except (StorageError, OSError, ValueError) as e:
                if root not in self._beat_failed:
                    log.warning("discovery: cannot write %s/%s (peers cannot find this daemon): %s", root, self.key, e)
                self._beat_failed.add(root)
            else:
                self._beat_failed.discard(root)

    def ring(self, root: str) -> list[str]:
        """The sorted URLs of the fresh records under served ``root``, this daemon's included."""
        with self._listing:  # the refresh thread and replica pushes share the record cache
            ring = self._ring(root)
        with self._lock:
            self._rings[root] = ring
        return ring

    def _ring(self, root: str) -> list[str]:
        store = self.store_of(root)
        now = time.time()
        seen = self._seen.setdefault(root, {})
        urls = {self.me}
        listed: set[str] = set()
        for o in islice(store.list(f"{DIR}/"), MAX_RECORDS):
            listed.add(o.key)
            known = seen.get(o.key)
            if known is None or known[0] != o.size:
                m = _NAME.fullmatch(o.key[len(DIR) + 1 :])
                try:
                    url = self._read(store, root, o.key, o.size, m.group(1) if m else None)
                except (StorageError, OSError) as e:  # not the record's fault: read it again next time
                    if not isinstance(e, NotFoundError):  # deleted since the listing: a clean shutdown
                        log.warning("discovery: cannot read daemon record %s/%s: %s", root, o.key, e)
                    continue
                known = seen[o.key] = (o.size, url)
            if known[1] is not None and now - clamp(o.mtime, now) <= self.ttl_s:
                urls.add(known[1])
        for k in [k for k in seen if k not in listed]:
            del seen[k]
        return sorted(urls)

    def _read(self, store: Store, root: str, key: str, size: int, name_id: str | None) -> str | None:
        """The URL of the record ``key``, or None for a bad record (logged once: the caller
        remembers it). StorageError when storage fails."""
        try:
            if name_id is None:
                raise ValueError("its name is not <32 hex digits>.json")
            if size > MAX_RECORD_BYTES:
                raise ValueError(f"{size} bytes is over {MAX_RECORD_BYTES}")
            raw = store.get(key, limit=MAX_RECORD_BYTES)
            if len(raw) > MAX_RECORD_BYTES:
                raise ValueError(f"{len(raw)} bytes is over {MAX_RECORD_BYTES}")
            return parse_record(raw, name_id)
        except ValueError as e:
            log.warning("discovery: ignoring daemon record %s/%s: %s", root, key, e)
            return None

    def dial(self, url: str, timeout_s: float) -> DaemonConnection:
        """A connection to ``url`` that passed the challenge (else NotVerified). It sends no
        token until the caller sets one, and is never replaced (``reconnect`` off): a new
        connection would not have passed the challenge."""
        conn = DaemonConnection(url, None, timeout_s)
        conn.reconnect = False
        try:
            challenge(conn, url, self.token)
        except BaseException:
            conn.close()
            raise
        return conn

    def verify(self, url: str) -> bool:
        """Whether ``url`` passed the challenge within ``ttl_s`` (else challenge it now). A URL
        that failed is not dialled again for ``ttl_s / 2`` and is logged once until it passes."""
        now = time.monotonic()
        with self._lock:
            at = self._verified.get(url)
            failed = self._failed.get(url)
        if at is not None and now - at <= self.ttl_s:
            return True
        if failed is not None and now - failed <= self.ttl_s / 2:
            return False
        try:
            self.dial(url, self.timeout_s).close()
        except NotVerified as e:
            self.unreachable[url] = {"time": time.time(), "error": f"discovery: {e}"}
            with self._lock:
                self._verified.pop(url, None)
                first = url not in self._failed
                self._failed[url] = time.monotonic()
            if first:
                log.warning("discovery: not replicating to %s", e)
            return False
        self.unreachable.pop(url, None)
        with self._lock:
            self._verified[url] = time.monotonic()
            self._failed.pop(url, None)
        return True

    def targets(self, job_root: str, k: int) -> list[str]:
        """The first ``k`` daemons after this one in ``job_root``'s ring that pass the challenge."""
        served = self._served.containing(job_root)  # where the ring's records live
        if served is None or k <= 0:
            return []
        return list(islice(filter(self.verify, self._order(served)), k))

    def _order(self, root: str) -> list[str]:
        """``replica_targets`` order of served ``root``'s ring, read now; [] (logged) if unreadable."""
        try:
            ring = self.ring(root)
        except (StorageError, OSError, ValueError) as e:
            log.warning("discovery: cannot list the daemons of %s: %s", root, e)
            return []
        return replica_targets(ring, self.me, len(ring))

    def refresh(self) -> None:
        """Read every served root's ring and challenge its members: the verified ones are the
        peers named to restoring ranks."""
        peers: set[str] = set()
        seen: set[str] = set()
        targets: list[str] = []
        for root in self.roots:
            order = self._order(root)
            good = [u for u in order if self.verify(u)]
            peers.update(good)
            targets = targets or good[: self.replicas]
            seen.update(order)
        with self._lock:  # forget the challenges of URLs no ring names any more
            for table in (self._verified, self._failed):
                for url in [u for u in table if u not in seen]:
                    del table[url]
        if self.on_refresh is not None:
            self.on_refresh(sorted(peers | {self.me}), targets)

    def describe(self) -> dict:
        with self._lock:
            return {"daemon": self.id, "rings": {r: list(v) for r, v in self._rings.items()}}


# -------------------------------------------------------------------------------- route

router = APIRouter()


@router.get(HELLO_PATH, summary="the discovery challenge: HMAC(peer key or token, nonce, this URL); needs no token")
def hello(request: Request, nonce: str = Query(min_length=2 * NONCE_BYTES, max_length=2 * NONCE_BYTES)):
    tiers = request.app.state.tiers
    token = tiers.peer_key.decode() if tiers.peer_key else request.app.state.token  # as ``Discovery`` keys it
    # Only a daemon that is itself in a discovered ring answers: anyone who reaches the route gets
    # a MAC keyed by the peer key (or token) to test guesses of it offline, so a daemon that
    # nobody discovers (no --discover) must not offer one.
    if token is None or tiers.me is None or tiers.discovery is None:
        return JSONResponse({"detail": "this daemon is not in a discovered ring (--discover)"}, status_code=404)
    try:
        raw = bytes.fromhex(nonce)
    except ValueError:
        return JSONResponse({"detail": "nonce must be hex"}, status_code=400)
    return {"mac": hello_mac(token, raw, tiers.me)}
