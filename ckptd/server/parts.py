"""What every route of the daemon reaches: its parts (``Daemon``) and who is calling (``Caller``).

``create_app`` builds one ``Daemon`` and keeps it on ``app.state.daemon``; a route asks for it
with the ``Parts`` dependency and for the caller (``ckptd.server.tenancy``: its uid from the Unix
socket, or a trusted TCP client) with ``Who``. A route module (``app``'s groups,
``staging_routes``) imports these from here, never from ``app``, which imports the routes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from ckptd.server.jobs import Runner
from ckptd.server.metrics import Metrics
from ckptd.server.roots import RootError, Roots
from ckptd.server.staging import Staging
from ckptd.server.tenancy import Caller, Forbidden, Tenancy

__all__ = ["Daemon", "Parts", "Who", "own_lease"]


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

    def root_of(self, root: str | None) -> str:
        """The job root a request names, or the only one served when it names none."""
        if root is None:
            only = self.roots.only()
            if only is None:
                raise RootError(
                    f"this daemon serves several roots; name one with ?root= ({', '.join(self.roots.uris)})"
                )
            return only
        return self.roots.check(root)


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
