"""The daemon's bearer token as a client reads it: ``CKPTD_TOKEN``, else the file that
``CKPTD_TOKEN_FILE`` names. One reading for every client of the daemon (``ckptd.daemon_conn``):
the trainer hooks and the CLI (``ckptd ls --daemon``)."""

from __future__ import annotations

import os
from pathlib import Path

from ckptd.errors import CheckpointError

__all__ = ["daemon_token"]


def daemon_token() -> str | None:
    """The token, or None without either variable; CheckpointError when the file cannot be read."""
    token = os.environ.get("CKPTD_TOKEN")
    path = os.environ.get("CKPTD_TOKEN_FILE")
    if not token and path:
        try:
            token = Path(path).read_text().strip()
        except OSError as e:
            raise CheckpointError(f"cannot read CKPTD_TOKEN_FILE {path}: {e}") from None
    return token or None
