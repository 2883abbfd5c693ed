"""The daemon's HTTP API (FastAPI). ``create_app(settings)`` builds everything and recovers the
staging folder before the first request, so a daemon that cannot start says so at once.

Errors are JSON ``{"detail": "..."}``: 400 a malformed request, a root not served, keys or paths
escaping the job root or the staging lease; 401 a missing or wrong bearer token; 403 a lease,
job or job root of another local user, or a lease or hand-off over TCP that the daemon does not
trust (``ckptd.server.tenancy``); 404 unknown lease, job or step; 409 a lease the daemon is
still uploading from, or a step already committed; 413 a body over the limit; 429 (with
``Retry-After``) the staging budget is full -- the client waits and asks again; 502 the job
root's storage failed or holds something unreadable.

Routes live on the ``APIRouter``s listed in ``ROUTERS`` and reach the daemon's parts through the
``Parts`` and ``Who`` dependencies (``ckptd.server.parts``); a new group of routes is a router in
a module of its own (``staging_routes``, ``page``, ``peers``) plus one entry there. Routes raise the
error types of the layers below and ``ERRORS`` (one table) turns them into status codes, so no
route catches an error only to translate it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import shutil
import stat
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, Field

from ckptd import __version__, catalog
from ckptd import manifest as mf
from ckptd.daemon_conn import default_socket
from ckptd.errors import AlreadyCommitted, CheckpointError, CheckpointNotFoundError
from ckptd.server import capacity, jobroots
from ckptd.server.discovery import HELLO_PATH, Discovery
from ckptd.server.discovery import router as discovery
from ckptd.server.handoff import FINAL, BadJob
from ckptd.server.jobs import Runner
from ckptd.server.metrics import Metrics
from ckptd.server.page import PUBLIC_PATHS
from ckptd.server.page import router as page
from ckptd.server.parity import check_ec
from ckptd.server.parts import MAX_NUMBER, MAX_RANK, MAX_STEP, Count, Daemon, Parts, Rank, Step, Who, own_lease
from ckptd.server.peers import router as peers
from ckptd.server.roots import RootError, Roots
from ckptd.server.safefiles import open_private_dir
from ckptd.server.settings import Settings, default_staging_dir, group_id
from ckptd.server.spill import Spill
from ckptd.server.staging import BudgetFull, LeaseBusy, LeaseGone, Staging
from ckptd.server.staging_routes import router as leases
from ckptd.server.tenancy import Forbidden, Tenancy, can_isolate
from ckptd.server.tiers import Tiers
from storage_backends import StorageError

__all__ = [
    "ERRORS",
    "FEATURES",
    "Guard",
    "HANDLERS",
    "JobRequest",
    "LayoutModel",
    "MetadataModel",
    "RETRY_AFTER_S",
    "ROUTERS",
    "RootRequest",
    "ShardModel",
    "create_app",
    "read_token",
]

log = logging.getLogger("ckptd.server")

RETRY_AFTER_S = 1
_NAME = Field(min_length=1, max_length=64)


# ``image_handoff``: shard files may be object images ("image": true); ``job_long_poll``:
# GET /v1/jobs/{id} takes ``wait``.
FEATURES = ("image_handoff", "job_long_poll", "memory_only_steps")


class RootRequest(BaseModel):
    root: str = Field(min_length=1, max_length=4096)


class LayoutModel(BaseModel):
    shape: list[Count] = Field(max_length=64)
    dtype: str = Field(max_length=32)
    shard_shape: list[Count] = Field(max_length=64)
    chunk_shape: list[Count] = Field(max_length=64)


class ShardModel(BaseModel):
    key: str = Field(min_length=1, max_length=4096)
    layout: LayoutModel
    coord: list[Count] = Field(max_length=64)
    file: str = _NAME
    image: bool = Field(False, description="the file is the shard's object image (trainer_hooks.snapshot)")


class MetadataModel(BaseModel):
    key: str = Field(min_length=1, max_length=4096)
    file: str = _NAME


class JobRequest(BaseModel):
    job: str | None = Field(None, max_length=64, description="client-chosen id (hex): a retried hand-off is idempotent")
    lease: str = _NAME
    root: str = Field(min_length=1, max_length=4096)
    step: Step
    attempt: str = _NAME
    writer: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:@-]{1,128}$", description="the job id claiming the step")
    rank: Rank
    world_size: int = Field(ge=1, le=MAX_RANK + 1)
    shards: list[ShardModel]
    metadata: list[MetadataModel] = []
    done: dict = {}
    commit_timeout: float = Field(1800.0, gt=0, le=7 * 86400)
    memory_only: bool = Field(False, description="hold the step in the memory tier only (server.tiers)")


class Guard:
    """Bearer-token check (every path but ``/healthz`` and the status page's data-free shell,
    ``page.PUBLIC_PATHS``; constant-time compare), a cross-site check, and a body size limit
    (``Content-Length`` checked up front; chunked bodies counted as they arrive).

    Cross-site: a browser that a web page from elsewhere drives sends ``Origin`` (and
    ``Sec-Fetch-Site``) with every POST; a request that changes anything (any method but GET and
    HEAD) from another origin is 403, with or without a token (``--insecure-no-auth`` has none
    to forge). Trainers and the CLI send neither header."""

    def __init__(self, app, token: str | None, max_body: int):
        self.app = app
        self.token = token.encode() if token is not None else None
        self.max_body = max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if scope["method"] not in ("GET", "HEAD") and _cross_site(headers):
            return await _send(send, 403, {"detail": "cross-site request refused (Origin is not this daemon)"})
        if self.token is not None and scope["path"] not in _OPEN_PATHS:
            auth = headers.get(b"authorization", b"")
            scheme, _, given = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.token):
                return await _send(
                    send, 401, {"detail": "missing or wrong bearer token"}, [(b"www-authenticate", b"Bearer")]
                )
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await _send(send, 413, {"detail": f"request body over {self.max_body} bytes"})
        if length is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body, more = b"", True
            while more:
                msg = await receive()
                if msg["type"] != "http.request":
                    return await self.app(scope, receive, send)
                body += msg.get("body", b"")
                more = msg.get("more_body", False)
                if len(body) > self.max_body:
                    return await _send(send, 413, {"detail": f"request body over {self.max_body} bytes"})
            whole = [{"type": "http.request", "body": body, "more_body": False}]

            async def replay():
                return whole.pop() if whole else await receive()

            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)


# Paths that need no token: liveness, the page's data-free shell, and the discovery challenge
# (answered only with an HMAC bound to this daemon's URL: ``server.discovery``).
_OPEN_PATHS = frozenset({"/healthz", HELLO_PATH, *PUBLIC_PATHS})


def _cross_site(headers: dict[bytes, bytes]) -> bool:
    """True when a browser says the request comes from a page of another origin."""
    site = headers.get(b"sec-fetch-site")
    if site is not None and site.strip().lower() not in (b"same-origin", b"none"):
        return True
    origin = headers.get(b"origin")
    if origin is None:
        return False
    host = headers.get(b"host", b"").strip().lower()
    try:
        parts = urlsplit(origin.decode("latin-1").strip())
    except ValueError:
        return True
    return parts.scheme not in ("http", "https") or parts.netloc.lower().encode("latin-1") != host


async def _send(send, status: int, obj: dict, extra: list | None = None) -> None:
    data = json.dumps(obj).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _error(status: int, detail: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


MAX_TOKEN_FILE_BYTES = 4096
MIN_PEER_KEY = 32  # characters of a peer key at least (e.g. ``openssl rand -hex 32``: 64)


def read_token(path: str | None, peer: bool = False) -> str | None:
    """The bearer token in ``path`` (``--token-file``), or ValueError (one line). A file its group
    or others can write is refused (they could replace the token with one they know); one every
    local user can read is logged as a WARNING. The checks and the read use one descriptor
    (``fstat``), so the file checked is the file read. ``peer``: the peer key (``--peer-key-file``),
    which trainers never hold: the file must be the daemon user's, with no group or other bits,
    and the key at least ``MIN_PEER_KEY`` characters."""
    what = "peer key file" if peer else "token file"
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            mode = stat.S_IMODE(st.st_mode)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{what} {path} is not a regular file")
            if peer and (mode & 0o077 or st.st_uid != os.geteuid()):
                raise ValueError(
                    f"refusing {what} {path} (mode {mode:o}, uid {st.st_uid}): it must belong to the daemon's "
                    f"user (uid {os.geteuid()}) and be readable by nobody else; chown it and chmod 600 {path}"
                )
            if mode & (stat.S_IWGRP | stat.S_IWOTH):
                who = "every local user" if mode & stat.S_IWOTH else "its group"
                raise ValueError(
                    f"refusing token file {path}: it is writable by {who} (mode {mode:o}), who could replace "
                    f"the token with one they know; chmod go-w {path} (0600, or 0640 for the trainers' group)"
                )
            if st.st_size > MAX_TOKEN_FILE_BYTES:
                raise ValueError(f"{what} {path} is over {MAX_TOKEN_FILE_BYTES} bytes: not a token")
            raw = os.read(fd, MAX_TOKEN_FILE_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        token = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not UTF-8 text") from None
    if len(token) < (MIN_PEER_KEY if peer else 1):
        raise ValueError(f"{what} {path} is empty" + (f" or under {MIN_PEER_KEY} characters" if peer else ""))
    if mode & stat.S_IROTH:
        log.warning("token file %s is readable by every local user (mode %o): chmod o-r it", path, mode)
    return token


# Error type -> HTTP status, looked up along the raised exception's MRO (so a subclass listed
# here wins over its base: CheckpointNotFoundError is 404, any other CheckpointError 502).
ERRORS: dict[type[Exception], int] = {
    RootError: 400,  # a root not served, or not a valid root
    Forbidden: 403,  # another local user's lease, job or job root; an unidentified caller
    BadJob: 400,  # a hand-off that fails validation
    CheckpointNotFoundError: 404,
    LeaseGone: 404,
    LeaseBusy: 409,  # the daemon still uploads from that lease
    AlreadyCommitted: 409,  # a committed checkpoint is immutable
    CheckpointError: 502,  # the job root holds something unreadable
    StorageError: 502,  # the job root's storage failed
    RecursionError: 400,  # a request body nested deeper than JSON parsing or encoding goes
}


async def _mapped_error(_req: Request, exc: Exception) -> JSONResponse:
    status = next(ERRORS[t] for t in type(exc).__mro__ if t in ERRORS)
    # KeyError's str() quotes its message; the message is its first argument
    return _error(status, str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc))


async def _budget_full(req: Request, exc: BudgetFull) -> JSONResponse:
    req.app.state.daemon.metrics.inc("ckptd_budget_waits_total")
    return JSONResponse(
        {"detail": str(exc), "staged": exc.staged, "budget": exc.budget},
        status_code=429,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


async def _bad_request(_req: Request, exc: RequestValidationError) -> JSONResponse:
    errs = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors()[:5])
    return _error(400, f"malformed request: {errs}")


HANDLERS = {RequestValidationError: _bad_request, BudgetFull: _budget_full, **dict.fromkeys(ERRORS, _mapped_error)}

read_only = APIRouter()


@read_only.get("/healthz", summary="liveness; never needs a token")
def healthz():
    return {"status": "ok"}


@read_only.get("/v1/status", summary="staging, budget, queue")
def status(d: Parts):
    return {
        "version": __version__,
        # what this daemon accepts beyond the first API: clients check before using them
        "features": list(FEATURES),
        "roots": d.roots.uris,
        "staging_dir": str(d.staging_dir),
        "budget": d.staging.budget,
        "staged_bytes": d.staging.staged_bytes,
        "leases": d.staging.lease_count,
        "queue_depth": d.runner.queue_depth,
        "awaiting_commit": d.runner.watching,
    }


@read_only.get("/v1/roots", summary="the job roots served")
def list_roots(d: Parts):
    return {"roots": d.roots.uris}


@read_only.post("/v1/roots/check", summary="400 unless the root is served")
def check_root(body: RootRequest, d: Parts):
    return {"root": d.roots.check(body.root)}


@read_only.get("/v1/job-roots", summary="the job roots found at and below a served root (bounded scan, paged)")
def list_job_roots(
    request: Request,
    d: Parts,
    root: str | None = Query(None, max_length=4096),
    offset: int = Query(0, ge=0, le=MAX_NUMBER),
    limit: int = Query(100, ge=1, le=1000),
):
    base = d.root_of(root)
    found = jobroots.shared(request.app.state).get(base)
    return {
        "root": base,
        "count": len(found.roots),
        "offset": offset,
        "limit": limit,
        "truncated": found.truncated,
        "max_depth": jobroots.MAX_DEPTH,
        "job_roots": list(found.roots[offset : offset + limit]),
    }


@read_only.get("/v1/checkpoints", summary="every checkpoint of a job root, committed or partial")
def list_checkpoints(d: Parts, who: Who, root: str | None = Query(None, max_length=4096)):
    return [i.to_json() for i in catalog.list_checkpoints(d.runner.store(d.readable(who, root)))]


@read_only.get("/v1/checkpoints/{step}", summary="one checkpoint: commit state and, if committed, its tensors")
def get_checkpoint(
    d: Parts, who: Who, step: int = PathParam(ge=0, le=MAX_STEP), root: str | None = Query(None, max_length=4096)
):
    r = d.readable(who, root)
    store = d.runner.store(r)
    info = next((i for i in catalog.list_checkpoints(store) if i.step == step), None)
    if info is None:
        return _error(404, f"{r}: no checkpoint at step {step}")
    out = info.to_json()
    if info.committed:
        out["tensors"] = [t.to_json() for t in catalog.load_manifest(store, step).tensors.values()]
    return out


@read_only.get("/metrics", response_class=PlainTextResponse, summary="Prometheus text format")
def prometheus(d: Parts):
    return PlainTextResponse(d.metrics.render(), media_type="text/plain; version=0.0.4")


jobs = APIRouter()


@jobs.post("/v1/jobs", summary="hand off one rank's snapshot; from the 200 on the daemon owns it")
def submit_job(body: JobRequest, d: Parts, who: Who):
    own_lease(d, who, body.lease, "a hand-off")
    d.tenancy.check_write(who, d.roots.check(body.root), bind=True)
    return d.runner.accept(body.model_dump()).status()


@jobs.get("/v1/jobs", summary="recent jobs: the caller's own (an operator's: all)")
def list_jobs(d: Parts, who: Who, limit: int = Query(100, ge=1, le=4096)):
    mine = [j for j in d.runner.recent(d.runner.HISTORY) if d.tenancy.owns(who, j.uid)]
    return [j.status() for j in mine[-limit:]]


@jobs.get("/v1/jobs/{job_id}", summary="a job's state: queued, uploading, uploaded, committed, failed, discarded")
async def get_job(
    job_id: str,
    d: Parts,
    who: Who,
    wait: float = Query(
        0.0, ge=0, le=60, description="long poll: answer as soon as the job is final, or after this many seconds"
    ),
):
    job = d.runner.get(job_id)
    if job is None or not d.tenancy.owns(who, job.uid):
        return _error(404, f"no job {job_id!r}")
    if wait and job.state not in FINAL:
        # Woken by the upload thread the moment the job is final: no polling on the event loop
        # (whose wake-ups competed for the GIL with the upload), no polling delay.
        loop, final = asyncio.get_running_loop(), asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed (shutdown)
                loop.call_soon_threadsafe(final.set)

        cancel = d.runner.on_final(job_id, wake)
        try:
            if job.state not in FINAL:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(final.wait(), wait)
        finally:
            cancel()
    return job.status()


# Every group of routes the daemon serves, in this order.
ROUTERS: tuple[APIRouter, ...] = (read_only, leases, jobs, page, peers, discovery)


def _discovery(settings: Settings, roots: Roots, runner: Runner, tiers: Tiers, key: str | None):
    """The ``--discover`` part of the memory tier (``server.discovery``; ``key``: the challenge's,
    the peer key where one is set, else the token), or None."""
    if not settings.discover:
        return None
    finder = Discovery(runner.store, roots, settings, key or "")

    def update(peers: list[str], targets: list[str]) -> None:
        tiers.peers, tiers.targets = peers, targets

    finder.on_refresh, finder.unreachable = update, tiers.unreachable
    tiers.discovery = finder
    log.info("discovery: this daemon (%s) writes _daemons/%s.json under its roots", settings.advertise, finder.id)
    return finder


def _check_discovery(settings: Settings, token: str | None) -> None:
    """ValueError (one line) for a ``--discover`` the other settings do not allow."""
    if not settings.discover:
        return
    if settings.peers:
        raise ValueError("--discover and --peers exclude each other: give the ring, or let the daemons find it")
    if not settings.advertise:
        raise ValueError("--discover needs --advertise URL: the address peers push replicas to")
    if token is None:
        raise ValueError("--discover needs --token-file: discovered peers must prove they hold the token")
    if not settings.tiers:
        raise ValueError("--discover has nothing to find peers for with --no-tiers")
    if settings.discover_ttl_s <= settings.discover_interval_s:
        raise ValueError("CKPTD_DISCOVER_TTL_S must be longer than CKPTD_DISCOVER_INTERVAL_S")


def _capacity(metrics: Metrics) -> None:
    """Raise the soft open-files limit to the hard one, log the limits that bound the memory
    tier (every held object is a descriptor and a mapping: ``server.capacity``), expose them."""
    raised = capacity.raise_open_files()
    lim = capacity.refresh()
    log.info(
        "capacity: open files %s%s, vm.max_map_count %s: the memory tier holds at most %s objects",
        lim["open_files"],
        f" (raised from {raised[0]})" if raised else "",
        lim["max_map_count"],
        lim["objects"],
    )
    for name, text, key in (
        ("ckptd_open_files_limit", "the daemon's open-files limit (RLIMIT_NOFILE, soft)", "open_files"),
        ("ckptd_max_map_count", "vm.max_map_count: mappings a process may hold", "max_map_count"),
        ("ckptd_tier_objects_limit", "objects the memory tier may hold (limits less headroom)", "objects"),
        ("ckptd_tier_objects", "objects the memory tier holds (one descriptor and one mapping each)", "held"),
    ):
        metrics.gauge(name, text, lambda k=key: float(capacity.describe()[k] or 0))


def _check_writable(roots: Roots, uri: str) -> None:
    """Refuse to serve a root this daemon cannot write, before any trainer hands off a step that
    could then never commit: a probe object under its ``_daemons/`` folder, written and deleted
    through the store the daemon's uploads use (``Roots.open_store``)."""
    key = f"{mf.DAEMONS}/probe-{os.urandom(8).hex()}.tmp"
    try:
        store = roots.open_store(uri)
        store.put(key, b"")
        store.delete(key)
    except (StorageError, OSError) as e:
        raise RuntimeError(f"refusing to serve {uri}: this daemon cannot write there ({e})") from None


def create_app(settings: Settings) -> FastAPI:
    roots = Roots(settings.roots)
    for uri in settings.roots:
        _check_writable(roots, uri)
    token = read_token(settings.token_file)
    peer_key = read_token(settings.peer_key_file, peer=True)
    _check_discovery(settings, token)
    ec = None
    if settings.ec is not None:  # parity replaces copies: only a --replicas K > 0 given conflicts
        replicas = settings.replicas if "replicas" in settings.model_fields_set else 0
        ec = check_ec(settings.ec, replicas, settings.peers, settings.advertise, peer_key, settings.discover)
        settings.replicas = 0
    isolate = can_isolate() if settings.isolate_tenants is None else settings.isolate_tenants
    if settings.staging_dir:
        folder, why = Path(settings.staging_dir), "configured"
    else:
        folder, why = default_staging_dir(settings.budget, settings.roots)
        # The base above the per-roots folders: ours (or refused, as the staging folder would
        # be), listable by nobody else; others may traverse it to their lease folders only with
        # --staging-group or per-user lease folders (tenants reach their own lease folders and the
        # Unix socket through it).
        folder.parent.parent.mkdir(parents=True, exist_ok=True)
        os.close(open_private_dir(folder.parent, 0o711 if settings.staging_group or isolate else 0o700))
    # Only the parent here: Staging creates the folder itself (or adopts one it owns), never
    # exist_ok on a path another local user may have planted.
    folder.parent.mkdir(parents=True, exist_ok=True)
    budget = settings.budget if settings.budget is not None else shutil.disk_usage(folder.parent).free // 2
    if isolate and not can_isolate():
        raise RuntimeError("CKPTD_ISOLATE_TENANTS needs CAP_CHOWN and CAP_DAC_OVERRIDE (see deploy/systemd)")
    group = group_id(settings.staging_group)
    staging = Staging(folder, budget, settings.lease_ttl_s, settings.budget_stall_s, group, private=isolate)
    try:
        # Without a token everyone who connects is trusted anyway (--insecure-no-auth).
        tenancy = Tenancy(folder, settings.trust_tcp or token is None, settings.binds)
    except BaseException:
        staging.close()
        raise
    if group is not None and not isolate:
        log.warning(
            "tenants on this node are not isolated from each other: without CAP_CHOWN and CAP_DAC_OVERRIDE "
            "lease folders are shared with group %s, whose members can read each other's staged weights "
            "(see deploy/systemd/ckptd.service)",
            settings.staging_group,
        )
    metrics = Metrics()
    runner = Runner(settings, roots, staging, metrics)
    runner.owner_of = tenancy.owner_of  # files committed into a tenant's local root: the tenant's
    tiers = Tiers(
        staging,
        settings.peers,
        settings.advertise,
        settings.replicas,
        token,
        settings.replica_timeout_s,
        settings.tiers,
    )
    runner.tiers = tiers
    tiers.ec = ec
    tiers.bound_uid, tenancy.carried = tenancy.bound_uid, tiers.carried  # bindings travel with replicas
    tiers.share = settings.tenant_share
    tiers.peer_key = tenancy.peer_key = peer_key.encode() if peer_key else None
    if (settings.peers or settings.discover) and settings.tiers and peer_key is None:
        log.warning(
            "memory tier: no --peer-key-file: this daemon neither pushes replicas to its peers nor accepts theirs "
            "(daemons sign replicas with the peer key; the trainers' token is not enough)"
        )
    if settings.spill_dir and settings.tiers:
        try:
            tiers.spill = Spill(settings.spill_dir)
        except BaseException:
            staging.close()
            raise
        n = tiers.adopt(roots.check)
        log.info("memory tier: spilling complete copies to %s (%d adopted at start)", settings.spill_dir, n)
    finder = _discovery(settings, roots, runner, tiers, peer_key or token)
    for name, (text, fn) in tiers.gauges().items():
        metrics.gauge(name, text, fn)
    for name, (text, many) in tiers.origin_gauges().items():
        metrics.labelled(name, text, "origin", many)
    _capacity(metrics)
    runner.recover()
    metrics.gauge("ckptd_queue_depth", "handed-off snapshots not yet uploaded", lambda: runner.queue_depth)
    metrics.gauge("ckptd_jobs_awaiting_commit", "uploaded snapshots waiting for other ranks", lambda: runner.watching)
    metrics.gauge("ckptd_staged_bytes", "bytes held in staging leases", lambda: staging.staged_bytes)
    metrics.gauge("ckptd_staging_budget_bytes", "the staging budget", lambda: staging.budget)
    metrics.gauge("ckptd_leases", "staging leases", lambda: staging.lease_count)
    log.info("staging in %s (%s), budget %d bytes; serving %s", folder, why, budget, ", ".join(roots.uris))

    @asynccontextmanager
    async def lifespan(_app):
        if finder is not None:
            finder.start()
        yield
        if finder is not None:
            finder.close()
        runner.close()
        staging.close()

    app = FastAPI(
        title="ckptd",
        version=__version__,
        description="Owns every handed-off snapshot from hand-off to commit.",
        lifespan=lifespan,
    )
    sock = Path(settings.socket) if settings.socket else default_socket()
    app.state.daemon = Daemon(roots, runner, staging, metrics, folder, tenancy, sock)
    app.state.tiers = tiers
    app.state.token = token  # for the connection limits (``ckptd.server.conns``): who is known
    app.add_middleware(Guard, token=token, max_body=settings.max_body_bytes)
    for exc_type, handler in HANDLERS.items():
        app.add_exception_handler(exc_type, handler)
    for router in ROUTERS:
        app.include_router(router)
    return app
