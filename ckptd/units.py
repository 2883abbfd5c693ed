"""Byte counts as people read them, shared by the CLI and the daemon's page (the server may not
import the CLI, so the one formatter lives in the core)."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: float | None) -> str:
    """``3.0 MiB``; under 1 KiB whole bytes (a rate says "512 B", not "512.7 B")."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{int(n)} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024:
            return f"{size:.1f} {unit}"
    return f"{size / 1024:.1f} PiB"
