"""What every route of the daemon reaches: its parts (``Daemon``) and who is calling (``Caller``).

``create_app`` builds one ``Daemon`` and keeps it on ``app.state.daemon``; a route asks for it
with the ``Parts`` dependency and for the caller (``ckptd.server.tenancy``: its uid from the Unix
socket, or a trusted TCP client) with ``Who``. A route module (``app``'s groups,
``staging_routes``) imports these from here, never from ``app``, which imports the routes.

Every number a request carries is bounded here, once: a count, size or offset (``Count``) is an
integer in [0, ``MAX_NUMBER``] (2^53: exact as a JSON number and as a float, so every counter it
feeds stays finite); a step is in [0, ``MAX_STEP``], a rank or world size in [0, ``MAX_RANK``].
Anything else is a 422 before a route runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from pydantic import Field

from ckptd.server.jobs import Runner
from ckptd.server.metrics import Metrics
from ckptd.server.roots import RootError, Roots
from ckptd.server.staging import Staging
from ckptd.server.tenancy import Caller, Forbidden, Tenancy

__all__ = ["MAX_NUMBER", "MAX_RANK", "MAX_STEP", "Count", "Daemon", "Parts", "Rank", "Step", "Who", "own_lease"]

MAX_NUMBER = 2**53
MAX_STEP = 10**10 - 1
MAX_RANK = (1 << 24) - 1
Count = Annotated[int, Field(ge=0, le=MAX_NUMBER)]
Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
Rank = Annotated[int, Field(ge=0, le=MAX_RANK)]


@dataclass(frozen=True)
class Daemon:
    """The parts every route uses, built once by ``create_app`` and kept on ``app.state.daemon``."""

    roots: Roots
    runner: Runner
    staging: Staging
    metrics: Metrics
    staging_dir: Path
    tenancy: Tenancy | None = None
    socket_path: Path | None = None  # the Unix socket ``ckptd serve`` listens on (None: none)

    def readable(self, who: Caller, root: str | None) -> str:
        """``root_of(root)``, if ``who`` may read it (``Tenancy.check_read``: 403 otherwise)."""
        r = self.root_of(root)
        self.tenancy.check_read(who, r)
        return r

    def root_of(self, root: str | None) -> str:
        """The job root a request names, or the only one served when it names none."""
        if root is not None:
            return self.roots.check(root)
        only = self.roots.only()
        if only is None:
            raise RootError(f"this daemon serves several roots; name one with ?root= ({', '.join(self.roots.uris)})")
        return only


def _daemon(request: Request) -> Daemon:
    return request.app.state.daemon


Parts = Annotated[Daemon, Depends(_daemon)]


def _caller(request: Request) -> Caller:
    return request.app.state.daemon.tenancy.caller(request.scope)


Who = Annotated[Caller, Depends(_caller)]


def own_lease(d: Daemon, who: Caller, lease_id: str, what: str):
    """The lease, if ``who`` may use it (403 if it is another uid's; 404 if there is none)."""
    d.tenancy.identified(who, what)
    lease = d.staging.get(lease_id)
    if not d.tenancy.owns(who, lease.uid):
        raise Forbidden(f"lease {lease_id} belongs to another user: {who} may not use it")
    return lease
