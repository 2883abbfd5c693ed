"""How many objects the memory tier may hold: every held object costs descriptors and a mapping.

Each object of a hot copy or replica is its own memfd mapped into the daemon (``server.sealed``):
``FDS_PER_OBJECT`` descriptors (``RLIMIT_NOFILE``) and one mapping (``vm.max_map_count``). A
daemon whose copies used up either could not open the job root's files, accept a connection or
map a staging file. So the tier holds at most ``describe()["objects"]``: each limit less a headroom
(``FD_HEADROOM``/``MAP_HEADROOM``, or a quarter/eighth of the limit when that is more) and, for
descriptors, less those the daemon's own work holds at the time. ``take`` refuses an object past
it with ``OSError(EMFILE)``, which the tier handles like any allocation failure (the copy is not
kept; a replica is refused, HTTP 429). Sizing: docs/operations.md ("Descriptors and mappings").
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import sys
import threading
import time

__all__ = [
    "FDS_PER_OBJECT",
    "FD_HEADROOM",
    "MAP_HEADROOM",
    "describe",
    "room",
    "raise_open_files",
    "release",
    "take",
]

# Descriptors one held object costs: its memfd, and (before Python 3.13's ``trackfd=False``)
# the duplicate that ``mmap.mmap`` keeps of it.
FDS_PER_OBJECT = 1 if sys.version_info >= (3, 13) else 2
FD_HEADROOM = 256  # descriptors kept for the daemon's own work (sockets, staging and root files)
MAP_HEADROOM = 8192  # mappings kept for it (the interpreter, its libraries, staged files, malloc)

MEASURE_EVERY_S = 0.25  # how often ``take`` counts the descriptors the daemon's own work holds
NEAR_OBJECTS = 256  # within this many objects of the descriptors' room, ``take`` counts at every call

_lock = threading.Lock()
_held = 0
_other = 0  # descriptors open that are not the tier's (last measured)
_measured_at = -1e9
_limits: dict | None = None


def _read_limits() -> dict:
    nofile: int | None = None
    maps: int | None = None
    with contextlib.suppress(OSError, ValueError):
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        nofile = None if soft == resource.RLIM_INFINITY else int(soft)
    with contextlib.suppress(OSError, ValueError), open("/proc/sys/vm/max_map_count", "rb") as f:
        maps = int(f.read(32).strip())
    caps = [] if nofile is None else [_room_from(nofile, 0)]
    if maps is not None:
        caps.append(maps - max(MAP_HEADROOM, maps // 8))
    return {"open_files": nofile, "max_map_count": maps, "objects": max(0, min(caps)) if caps else None}


def refresh() -> dict:
    """Read the limits again (after ``raise_open_files``); the held count is kept."""
    global _limits
    got = _read_limits()
    with _lock:
        _limits = got
    return got


def describe() -> dict:
    """{"open_files", "max_map_count", "objects" (the tier's cap; None: no limit known), "held"}."""
    lim = _limits if _limits is not None else refresh()
    with _lock:
        return {**lim, "held": _held}


def _open_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own descriptor
    except OSError:
        return None


def _fd_room() -> int | None:
    """Objects the descriptors left allow: the open-files limit less the headroom and less what
    the daemon's own work holds now (staged files of saves in flight, connections), measured at
    most every ``MEASURE_EVERY_S`` (a listing of /proc/self/fd costs one entry per descriptor)
    while the tier is far from that room, and at every call within ``NEAR_OBJECTS`` of it: a
    save may open hundreds of staged files between two measurements, and a stale count near the
    limit let the tier take the descriptors that save then needed (EMFILE in its upload)."""
    global _other, _measured_at
    nofile = (_limits or {}).get("open_files")
    if nofile is None:
        return None
    now = time.monotonic()
    fresh = now - _measured_at >= MEASURE_EVERY_S
    if not fresh:
        with _lock:
            fresh = _room_from(nofile, _other) - _held <= NEAR_OBJECTS
    if fresh:
        live = _open_fds()
        if live is not None:
            with _lock:
                _other = max(0, live - _held * FDS_PER_OBJECT)
                _measured_at = now
    return _room_from(nofile, _other)


def _room_from(nofile: int, other: int) -> int:
    return (nofile - max(FD_HEADROOM, nofile // 4) - other) // FDS_PER_OBJECT


def _cap() -> int | None:
    """Objects the tier may hold now: the lower of the limits' cap and the descriptors' room."""
    caps = [c for c in (describe()["objects"], _fd_room()) if c is not None]
    return min(caps) if caps else None


def room() -> int | None:
    """How many more objects the tier may hold now (None: no limit known)."""
    cap = _cap()
    return None if cap is None else max(0, cap - describe()["held"])


def take() -> None:
    """Count one more held object; OSError(EMFILE) when the cap is reached (nothing counted)."""
    global _held
    cap = _cap()
    with _lock:
        if cap is not None and _held >= cap:
            lim = _limits or {}
            raise OSError(
                errno.EMFILE,
                f"the memory tier holds {_held} objects, all this daemon's limits allow now "
                f"(open files {lim.get('open_files')}, {_other} of them in use for saves and connections; "
                f"vm.max_map_count {lim.get('max_map_count')}; less headroom: see docs/operations.md)",
            )
        _held += 1


def release() -> None:
    global _held
    with _lock:
        _held = max(0, _held - 1)


def raise_open_files() -> tuple[int, int] | None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard one (the daemon never uses ``select``);
    returns (old soft, new soft), or None when nothing changed or it cannot be done (logged).
    The one place the daemon raises it (``create_app``; ``ckptd serve`` sizes its connection cap
    after it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard or (hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft > hard):
        return None
    new = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if new <= soft:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (OSError, ValueError) as e:
        logging.getLogger("ckptd.server").warning("cannot raise the open-files limit from %d to %d: %s", soft, new, e)
        return None
    refresh()
    return soft, new
