"""The routes of memory-only steps (``server.memsteps``): what a daemon holds, ranged reads of it
for restoring ranks, a client's reservation before its hand-off, and the part pushes of its peers.

Every route needs the daemon token (``app.Guard``) and names a served root; reads follow the
tenancy rule of the tier routes (``server.peers._readable_root``). Objects are looked up in the
table by (root, step, attempt, key), never by a path. A read answers with the step and attempt
in ``X-Ckptd-Step`` / ``X-Ckptd-Attempt``; the reader checks both, and every chunk against the
writers' pins (``trainer_hooks.memsteps``).
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from ckptd.server.memsteps import MAX_OBJECTS
from ckptd.server.peers import ReplicaObject, _readable_root, _root

__all__ = ["PartRequest", "ReserveRequest", "router"]

router = APIRouter()


class ReserveRequest(BaseModel):
    root: str = Field(min_length=1, max_length=4096)
    step: int = Field(ge=0, le=10**10 - 1)
    attempt: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    rank: int = Field(ge=0, lt=1 << 24)
    bytes: int = Field(ge=0, le=1 << 50)


class PartRequest(BaseModel):
    root: str = Field(min_length=1, max_length=4096)
    step: int = Field(ge=0, le=10**10 - 1)
    attempt: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    rank: int = Field(ge=0, lt=1 << 24)
    source: str = Field(min_length=1, max_length=4096)
    objects: list[ReplicaObject] = Field(max_length=MAX_OBJECTS)


def _ms(request: Request):
    return request.app.state.memsteps


@router.get("/v1/memsteps", summary="the complete parts of memory-only steps held for a root, and the peers")
def held(request: Request, root: str = Query(min_length=1, max_length=4096)):
    return {"parts": _ms(request).describe(_readable_root(request, root)), "peers": request.app.state.tiers.peers}


@router.get("/v1/memsteps/object", summary="a byte range of a held object of a memory-only step")
def read_object(
    request: Request,
    root: str = Query(min_length=1, max_length=4096),
    step: int = Query(ge=0, le=10**10 - 1),
    attempt: str = Query(min_length=1, max_length=64),
    key: str = Query(min_length=1, max_length=4096),
    start: int = Query(ge=0),
    length: int = Query(ge=0, le=1 << 34),
):
    try:
        data = _ms(request).read(_readable_root(request, root), step, attempt, key, start, length)
    except ValueError as e:
        return JSONResponse({"detail": str(e)}, status_code=416)
    if data is None:
        return JSONResponse({"detail": f"no part of step {step} attempt {attempt} holds {key!r}"}, 404)
    return Response(
        data, media_type="application/octet-stream", headers={"X-Ckptd-Step": str(step), "X-Ckptd-Attempt": attempt}
    )


@router.post("/v1/memsteps/reserve", summary="hold room for a rank's part of a memory-only step before its hand-off")
def reserve(body: ReserveRequest, request: Request):
    root = _root(request, body.root)
    return {"ok": _ms(request).reserve(root, body.step, body.attempt, body.rank, body.bytes)}


@router.post("/v1/memsteps/replicas", summary="a peer starts pushing a part; 429 when it does not fit")
def begin_part(body: PartRequest, request: Request):
    root = _root(request, body.root)
    try:
        rid = _ms(request).begin_replica(
            root, body.step, body.attempt, body.rank, body.source, [o.model_dump() for o in body.objects]
        )
    except ValueError as e:
        return JSONResponse({"detail": str(e)}, status_code=400)
    if not rid:
        return JSONResponse({"detail": "no room in the staging budget for this part"}, status_code=429)
    return {"replica": rid}


@router.put("/v1/memsteps/replicas/{rid}", summary="one piece of one object of a part")
async def put_piece(
    rid: str, request: Request, key: str = Query(min_length=1, max_length=4096), offset: int = Query(ge=0)
):
    data = await request.body()
    try:
        _ms(request).put_piece(rid, key, offset, data)
    except KeyError as e:
        return JSONResponse({"detail": str(e.args[0])}, status_code=404)
    except ValueError as e:
        return JSONResponse({"detail": str(e)}, status_code=400)
    return {"received": len(data)}


@router.post("/v1/memsteps/replicas/{rid}/seal", summary="the part is whole: check every object's crc32c")
def seal_part(rid: str, request: Request):
    try:
        _ms(request).seal(rid)
    except KeyError as e:
        return JSONResponse({"detail": str(e.args[0])}, status_code=404)
    except ValueError as e:
        return JSONResponse({"detail": str(e)}, status_code=400)
    return {"replica": rid, "complete": True}
