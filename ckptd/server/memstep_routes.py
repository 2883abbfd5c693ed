"""The routes of memory-only steps (``server.memsteps``): what parts a daemon holds (with their
keys and sizes, and its data path), and a client's reservation before its hand-off.

Everything else is the memory tier's (``server.peers``, ``server.tierdata``): the parts are
pushed to peers on ``/v1/tiers/replicas`` (kind ``memory_only``) and read by restoring ranks on
the tier's routes and data path, under the same rules. Every route needs the daemon token
(``app.Guard``) and names a served root; the listing follows the tenancy rule of the tier routes
(``server.peers._readable_root``).
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from ckptd.server.peers import _readable_root, _root

__all__ = ["ReserveRequest", "router"]

router = APIRouter()


class ReserveRequest(BaseModel):
    root: str = Field(min_length=1, max_length=4096)
    step: int = Field(ge=0, le=10**10 - 1)
    attempt: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    rank: int = Field(ge=0, lt=1 << 24)
    bytes: int = Field(ge=0, le=1 << 50)
    objects: int = Field(0, ge=0, le=1 << 24)  # the objects the part holds, at most


def _ms(request: Request):
    return request.app.state.memsteps


@router.get("/v1/memsteps", summary="the complete parts of memory-only steps held for a root, and the peers")
def held(request: Request, root: str = Query(min_length=1, max_length=4096)):
    tiers = request.app.state.tiers
    parts = _ms(request).describe(_readable_root(request, root))
    return {"parts": parts, "peers": tiers.peers, "data": tiers.data_endpoint}


@router.post("/v1/memsteps/reserve", summary="hold room for a rank's part of a memory-only step before its hand-off")
def reserve(body: ReserveRequest, request: Request):
    root = _root(request, body.root)
    # Room in the staging budget, for a root: the rule of a staging lease (``server.tenancy``),
    # else another local user could hold the budget or replace a tenant's reservation.
    tenancy = request.app.state.daemon.tenancy
    tenancy.check_write(tenancy.caller(request.scope), root, bind=False)
    return {"ok": _ms(request).reserve(root, body.step, body.attempt, body.rank, body.bytes, body.objects)}
