"""The memory tier's routes (``server.tiers``): what a daemon holds, ranged reads of it for
restoring ranks, its peers' replica pushes (``server.replication``), a client's reservation
before a memory-only hand-off, and the report (and fence) after a restore.

Every route needs the daemon token (``app.Guard``) and names a served root; the replica routes
also a request signed with the peer key, which only daemons hold (``peer_sender``): the token
alone is 403; a fence (``restored``) needs that or the right to write its root here. Listings
show the roots the caller may read (``Tenancy.visible``). Objects are looked up in the tier's
table by (root, step, attempt, key): no route turns a request into a path, so none can read
outside (or inside) the staging folder. A read answers with the step and attempt of the copy in
``X-Ckptd-Step`` / ``X-Ckptd-Attempt``; the reader checks both against the commit record and
every chunk against its crc32c (``trainer_hooks.tiered``).
"""

from __future__ import annotations

import hmac
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from ckptd.daemon_conn import PEER_HEADER, peer_mac
from ckptd.server.page_data import visible_tiers
from ckptd.server.parts import MAX_NUMBER, Count, Rank, Step
from ckptd.server.tenancy import Forbidden
from ckptd.server.tiers import MAX_BATCH_RANGES, MAX_OBJECTS, SELF, origin_of

__all__ = ["BatchReadRequest", "PEER_WINDOW_S", "ReplicaRequest", "ReserveRequest", "RestoredReport", "peer_sender"]
__all__ += ["router"]

PEER_WINDOW_S = 120  # a peer's signed time may differ from this daemon's clock by this much

router = APIRouter()

_ROOT = Query(min_length=1, max_length=4096)
_STEP = Query(ge=0, le=10**10 - 1)
_ATTEMPT = Query(min_length=1, max_length=64)


class ReplicaObject(BaseModel):
    key: str = Field(min_length=1, max_length=4096)
    size: Count
    crc32c: int = Field(ge=0, lt=2**32)


class _Held(BaseModel):  # the (root, step, attempt) of a copy in the memory tier
    root: str = Field(min_length=1, max_length=4096)
    step: Step
    attempt: str = Field(min_length=1, max_length=64)


class ReplicaRequest(_Held):  # its source is the signed sender (``peer_sender``), never a field
    # a hot copy, one rank's part of a memory-only step, or its shares of parity (``server.parity``)
    kind: Literal["hot", "memory_only", "parity"] = "hot"
    ranks: list[Rank] = Field(default_factory=list, max_length=1 << 20)
    objects: list[ReplicaObject] = Field(max_length=MAX_OBJECTS)
    uid: int | None = Field(None, ge=0, lt=2**32)  # the uid the sender binds its root to (``Tenancy.carried``)
    mac: str = Field("", pattern=r"^[0-9a-f]{0,64}$")  # a memory-only part's ``replication.part_mac``, checked at seal


class ReserveRequest(_Held):
    attempt: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    rank: int = Field(ge=0, lt=1 << 24)
    bytes: int = Field(ge=0, le=1 << 50)
    objects: int = Field(0, ge=0, le=1 << 24)  # the objects the part holds, at most


class RangeModel(BaseModel):
    key: str = Field(min_length=1, max_length=4096)
    start: int = Field(ge=-MAX_NUMBER, le=MAX_NUMBER)  # negative: from the end
    length: int = Field(ge=0, le=1 << 34)


class BatchReadRequest(_Held):
    ranges: list[RangeModel] = Field(min_length=1, max_length=MAX_BATCH_RANGES)


class RestoredReport(BaseModel):
    local: Count = 0
    peer: Count = 0
    root: Count = 0
    # A job of ``job_root`` restored ``restored_step``: memory-only steps newer than it are an
    # abandoned future and are dropped (``server.tiers.Tiers.fence``).
    job_root: str | None = Field(None, min_length=1, max_length=4096)
    restored_step: int | None = Field(None, ge=0, le=10**10 - 1)
    # the peers that gave the restore no answer: the fence is not waited for there
    silent: list[Annotated[str, Field(max_length=2048)]] = Field([], max_length=256)


async def peer_sender(request: Request) -> str:
    """The URL of the peer daemon that signed this request with the peer key (``PEER_HEADER``:
    ``daemon_conn.peer_auth``), its signed time within ``PEER_WINDOW_S`` of this clock and its
    signature not seen before (kept for twice the window); else Forbidden (403)."""
    tiers = request.app.state.tiers
    if tiers.peer_key is None:
        raise Forbidden("this daemon has no peer key (--peer-key-file): it accepts no replicas")
    try:
        sender, when, nonce, mac = request.headers.get(PEER_HEADER, "").split(" ")
        skew = abs(time.time() - int(when))
    except (ValueError, OverflowError):
        raise Forbidden(
            f"a route between daemons needs a request signed with the peer key ({PEER_HEADER}): "
            "the daemon token is not enough"
        ) from None
    s = request.scope
    target = (s.get("raw_path") or s["path"].encode()).decode("latin-1")
    target += f"?{s['query_string'].decode('latin-1')}" if s.get("query_string") else ""
    want = peer_mac(tiers.peer_key, request.method, target, await request.body(), when, nonce, sender)
    if not hmac.compare_digest(mac.encode(), want.encode()):
        raise Forbidden("wrong peer signature: not signed with this daemon's peer key (--peer-key-file)")
    if skew > PEER_WINDOW_S:
        raise Forbidden(f"peer signature {skew:.0f} s away from this daemon's clock (at most {PEER_WINDOW_S} s)")
    now, seen = time.monotonic(), tiers.peer_macs
    while seen and next(iter(seen.values())) < now - 2 * PEER_WINDOW_S:  # oldest first
        del seen[next(iter(seen))]
    if mac in seen:
        raise Forbidden("a replayed peer request")
    seen[mac] = now
    if sender == SELF:  # this daemon's own copies' source
        raise Forbidden(f"a peer cannot sign as {SELF!r}")
    return sender


def _root(request: Request, root: str) -> str:
    return request.app.state.daemon.roots.check(root)


def _readable_root(request: Request, root: str) -> str:
    """A served root the caller may read: hot copies are a tenant's weights, so the tenancy rule
    of the checkpoint routes holds here too (``ckptd.server.tenancy``: 403 inside another
    identity's root)."""
    d = request.app.state.daemon
    return d.readable(d.tenancy.caller(request.scope), root)


@router.get("/v1/tiers", summary="the complete copies this daemon holds in memory, its peers and its data path")
def describe(
    request: Request,
    root: str | None = Query(None, max_length=4096),
    step: int | None = Query(None, ge=0, le=10**10 - 1),
    attempt: str | None = Query(None, min_length=1, max_length=64),
    keys: bool = False,
):
    """Hot copies, replicas and memory-only parts (of ``root``; of exactly ``step`` and
    ``attempt`` when given); ``keys=true`` (with a root the caller may read) lists each copy's
    objects and their sizes: what a restoring rank reads."""
    if root is None:
        if keys or step is not None or attempt is not None:
            return JSONResponse({"detail": "name the root (?root=) to list keys or a step"}, status_code=400)
        tenancy = request.app.state.daemon.tenancy
        return visible_tiers(tenancy, tenancy.caller(request.scope), request.app.state.tiers.describe())
    return request.app.state.tiers.describe(_readable_root(request, root), step, attempt, keys)


@router.get("/v1/tiers/vouch", summary="a ticket naming the caller (Unix socket) to the ring as a reader of one root")
def vouch(request: Request, root: str = _ROOT):
    tenancy = request.app.state.daemon.tenancy
    return {"vouch": tenancy.vouch(tenancy.caller(request.scope), _root(request, root))}


@router.post("/v1/tiers/reserve", summary="hold room for a rank's part of a memory-only step before its hand-off")
def reserve(body: ReserveRequest, request: Request):
    root = _root(request, body.root)
    # Room in the staging budget, for a root: the rule of a staging lease (``server.tenancy``),
    # else another local user could hold the budget or replace a tenant's reservation.
    tenancy = request.app.state.daemon.tenancy
    who = tenancy.caller(request.scope)
    tenancy.check_write(who, root, bind=False)
    t = request.app.state.tiers
    ok = t.reserve(root, body.step, body.attempt, body.rank, body.bytes, body.objects, origin_of(who.uid))
    return {"ok": ok}


@router.get("/v1/tiers/object", summary="a byte range of a held shard object")
def read_object(
    request: Request,
    root: str = _ROOT,
    step: int = _STEP,
    attempt: str = _ATTEMPT,
    key: str = Query(min_length=1, max_length=4096),
    start: int = Query(ge=-MAX_NUMBER, le=MAX_NUMBER),
    length: int = Query(ge=0, le=1 << 34),
):
    request.app.state.tiers.count("object_requests")
    try:
        data = request.app.state.tiers.read(_readable_root(request, root), step, attempt, key, start, length)
    except ValueError as e:
        return JSONResponse({"detail": str(e)}, status_code=416)
    if data is None:
        return JSONResponse({"detail": f"no complete copy of step {step} attempt {attempt} holds {key!r}"}, 404)
    headers = {"X-Ckptd-Step": str(step), "X-Ckptd-Attempt": attempt}
    return Response(data, media_type="application/octet-stream", headers=headers)


@router.post("/v1/tiers/read", summary="byte ranges of several held shard objects, concatenated, in one reply")
def read_objects(body: BatchReadRequest, request: Request):
    """One request for many ranges (a restoring rank batches the shard objects it reads from one
    tier): the per-request cost of HTTP is paid once per batch, not once per shard object. All
    or nothing: 404 when any key is not held complete, 416 for a range outside its object."""
    t = request.app.state.tiers
    t.count("object_requests")
    root = _readable_root(request, body.root)
    try:
        data = t.read_many(root, body.step, body.attempt, [(r.key, r.start, r.length) for r in body.ranges])
    except ValueError as e:
        return JSONResponse({"detail": str(e)}, status_code=416)
    if data is None:
        return JSONResponse({"detail": f"no complete copy of step {body.step} attempt {body.attempt} holds them"}, 404)
    return _Parts(data, {"X-Ckptd-Step": str(body.step), "X-Ckptd-Attempt": body.attempt})


class _Parts(Response):
    """A reply whose body is sent as the held views themselves, one ASGI message each: no
    buffer is assembled for a batch (its Content-Length is their sum)."""

    media_type = "application/octet-stream"

    def __init__(self, parts: list[memoryview], headers: dict[str, str]):
        super().__init__(None, headers=headers | {"Content-Length": str(sum(len(p) for p in parts))})
        self.parts = [p for p in parts if len(p)]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for i, part in enumerate(self.parts or [b""]):  # an empty batch: one empty body message
            await send({"type": "http.response.body", "body": part, "more_body": i + 1 < len(self.parts)})


@router.post("/v1/tiers/replicas", summary="a peer starts pushing its hot copy; 429 when it does not fit")
def begin_replica(body: ReplicaRequest, request: Request, source: str = Depends(peer_sender)):
    root = _root(request, body.root)
    objects = [o.model_dump() for o in body.objects]

    def begin() -> str:
        return request.app.state.tiers.begin_replica(
            root, body.step, body.attempt, source, body.ranks, objects, body.kind, body.uid, body.mac
        )

    try:  # with a uid: read here as bound to it, unless this daemon binds it otherwise (403)
        rid = begin() if body.uid is None else request.app.state.daemon.tenancy.carry(root, body.uid, source, begin)
    except ValueError as e:
        return JSONResponse({"detail": str(e)}, status_code=400)
    if not rid:
        why = "not kept: no room in the staging budget, or no descriptor or mapping left (the daemon logs which)"
        return JSONResponse({"detail": why}, status_code=429)
    return {"replica": rid}


@router.put(
    "/v1/tiers/replicas/{rid}", summary="one piece of one object of a replica", dependencies=[Depends(peer_sender)]
)
async def put_piece(
    rid: str,
    request: Request,
    key: str = Query(min_length=1, max_length=4096),
    offset: int = Query(ge=0, le=MAX_NUMBER),
):
    data = await request.body()
    try:
        request.app.state.tiers.put_piece(rid, key, offset, data)
    except KeyError as e:
        return JSONResponse({"detail": str(e.args[0])}, status_code=404)
    except ValueError as e:
        return JSONResponse({"detail": str(e)}, status_code=400)
    return {"received": len(data)}


@router.post(
    "/v1/tiers/replicas/{rid}/seal",
    summary="the replica is whole: check every object's crc32c",
    dependencies=[Depends(peer_sender)],
)
def seal_replica(rid: str, request: Request):
    try:
        request.app.state.tiers.seal(rid)
    except KeyError as e:
        return JSONResponse({"detail": str(e.args[0])}, status_code=404)
    except ValueError as e:
        return JSONResponse({"detail": str(e)}, status_code=400)
    return {"replica": rid, "complete": True}


@router.get("/v1/tiers/ec", summary="own memory-only parts and parity blocks held (--ec), to a peer of the group")
def ec_holdings(request: Request, root: str = _ROOT, source: str = Depends(peer_sender)):
    return request.app.state.tiers.ec_holdings(_root(request, root))


@router.get("/v1/tiers/ec/block", summary="one block of a stripe (--ec), to a peer of the group rebuilding a part")
def ec_block(
    request: Request,
    root: str = _ROOT,
    step: int = _STEP,
    attempt: str = _ATTEMPT,
    lane: int = Query(ge=0, lt=1 << 12),
    stripe: int = Query(ge=0, lt=64),
    num: int = Query(ge=0, lt=64),
    source: str = Depends(peer_sender),
):
    tiers = request.app.state.tiers
    if tiers.ec is None:
        return JSONResponse({"detail": "this daemon keeps no erasure-coded tier (--ec)"}, status_code=404)
    try:
        raw = tiers.ec_block(_root(request, root), step, attempt, lane, stripe, num)
    except ValueError as e:
        return JSONResponse({"detail": str(e)}, status_code=400)
    if raw is None:
        return JSONResponse({"detail": f"no block {num} of stripe {stripe} held"}, status_code=404)
    return Response(raw, media_type="application/octet-stream")


class RebuildRequest(BaseModel):
    job_root: str = Field(min_length=1, max_length=4096)


@router.post("/v1/tiers/rebuild", summary="rebuild the memory-only parts lost daemons of the group held (--ec)")
def rebuild(body: RebuildRequest, request: Request):
    """A restoring rank asks its own daemon, before it chooses a memory-only step
    (``server.parity``, 3); needs the right to read the root. Answers the parts rebuilt."""
    return {"rebuilt": request.app.state.tiers.rebuild(_readable_root(request, body.job_root))}


async def _signed_peer(request: Request) -> str | None:
    """The signing peer daemon (``peer_sender``) of a request that names one, else None."""
    return await peer_sender(request) if PEER_HEADER in request.headers else None


@router.post("/v1/tiers/restored", summary="a rank reports the bytes its restore read from each tier")
def restored(body: RestoredReport, request: Request, peer: str | None = Depends(_signed_peer)):
    """A rank's report to its own daemon; with ``job_root``, the fence: only a caller that may
    write that root here (``Tenancy.check_write``, never binding it), or a signed peer daemon
    it was forwarded to. The own daemon forwards it to its peers (``Replication.fence_peers``)."""
    t, fenced = request.app.state.tiers, 0
    if body.job_root is not None and body.restored_step is not None:
        root = _root(request, body.job_root)
        if peer is None:
            tenancy = request.app.state.daemon.tenancy
            tenancy.check_write(tenancy.caller(request.scope), root, bind=False)
        fenced = t.fence(root, body.restored_step)
        if peer is None:
            t.fence_peers(root, body.restored_step, frozenset(body.silent))
    if peer is None:
        t.restored(body.local, body.peer, body.root)
    return {"ok": True, "fenced": fenced}
