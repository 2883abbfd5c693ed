"""The staging-lease routes: a trainer rank reserves shared memory for its snapshot, grows it,
keeps it alive, starts a save in it again, and gives it back (``ckptd.server.staging``).

Every route needs the daemon token (``app.Guard``) and, for an existing lease, that the caller
owns it (``parts.own_lease``: 403 another uid's, 404 none). A request that does not fit the
budget is ``BudgetFull``, which ``app.HANDLERS`` answers with 429 and ``Retry-After``: the
client waits and asks again.
"""

from __future__ import annotations

import contextlib

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, Field

from ckptd.server.parts import Count, Parts, Rank, Who, own_lease
from ckptd.server.staging import LeaseGone

__all__ = ["GrowRequest", "LeaseRequest", "router"]


class LeaseRequest(BaseModel):
    root: str = Field(min_length=1, max_length=4096)
    rank: Rank
    bytes: Count = Field(description="bytes needed now")
    want: Count = Field(0, description="bytes wanted (e.g. the whole snapshot), granted if they fit")
    client: str = Field(min_length=1, max_length=64, description="the requesting client, for fair waiting")


class GrowRequest(BaseModel):
    bytes: Count
    want: Count = 0


router = APIRouter()


@router.post("/v1/leases", summary="reserve staging memory; 429 while the budget is full")
def create_lease(body: LeaseRequest, d: Parts, who: Who):
    d.tenancy.identified(who, "a staging lease")
    r = d.roots.check(body.root)
    d.tenancy.check_write(who, r, bind=False)
    gid = who.peer.gid if who.peer is not None else None
    return d.staging.create(r, body.rank, body.bytes, body.want, body.client, who.uid, gid).info(d.staging.ttl)


@router.post("/v1/leases/{lease_id}/acquire", summary="start a save in a lease handed back by the daemon")
def acquire_lease(lease_id: str, d: Parts, who: Who):
    own_lease(d, who, lease_id, "a staging lease")
    return d.staging.acquire(lease_id).info(d.staging.ttl)


@router.post("/v1/leases/{lease_id}/grow", summary="more staging memory for a lease; 429 while full")
def grow_lease(lease_id: str, body: GrowRequest, d: Parts, who: Who):
    own_lease(d, who, lease_id, "a staging lease")
    return d.staging.grow(lease_id, body.bytes, body.want).info(d.staging.ttl)


@router.post("/v1/leases/{lease_id}/heartbeat", summary="the lease's client is alive")
def heartbeat_lease(lease_id: str, d: Parts, who: Who):
    own_lease(d, who, lease_id, "a staging lease")
    return d.staging.heartbeat(lease_id).info(d.staging.ttl)


@router.delete("/v1/leases/{lease_id}", status_code=204, summary="the client is done with its lease")
def release_lease(lease_id: str, d: Parts, who: Who):
    with contextlib.suppress(LeaseGone):
        own_lease(d, who, lease_id, "a staging lease")
        d.staging.release(lease_id)
    return Response(status_code=204)
