"""Memory-tier buffers that can be lent to another process without letting it change them.

A hot copy's or replica's object is filled through ``new_buffer`` (on Linux: a ``memfd`` mapped
shared and writable) and, once whole, turned by ``seal`` into a read-only mapping of the same
memory whose descriptor carries ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE``: from then on
nobody, the daemon included, can write, shrink or grow it, so the descriptor can be passed to a
restoring rank (``SCM_RIGHTS``, ``ckptd.server.tierdata``) which maps it ``PROT_READ``. A rank
that tries to write through the descriptor (``write``, ``ftruncate``, a shared writable ``mmap``)
gets EPERM and the daemon's copy is unchanged. Elsewhere (no ``memfd_create``) buffers are plain
``bytearray``s and are never shared.

A sealed buffer (``Sealed``, an ``mmap``) also holds its descriptor (``fd``), closed when the
buffer is collected: a dropped copy lives on while a reply still sends from it or a descriptor
is being passed. Each costs one descriptor (two before Python 3.13) and one mapping, counted
against the cap of ``server.capacity`` (OSError EMFILE past it, before any descriptor is made)
until its descriptor is closed.
"""

from __future__ import annotations

import mmap
import os
import sys
import weakref

from ckptd.server import capacity
from ckptd.tierwire import F_ADD_SEALS, SEALS

__all__ = ["SEALS", "Sealed", "can_share", "new_buffer", "seal"]

TRACKFD = sys.version_info >= (3, 13)  # ``mmap.mmap(..., trackfd=False)`` exists


def can_share() -> bool:
    return hasattr(os, "memfd_create") and hasattr(os, "MFD_ALLOW_SEALING")


class Sealed(mmap.mmap):
    """A mapping of a memfd, with the memfd's descriptor in ``fd`` (see the module doc)."""

    fd: int = -1
    sealed: bool = False


def _close(fd: int) -> None:
    os.close(fd)
    capacity.release()


def _adopt(fd: int, size: int, writable: bool) -> Sealed:
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    # trackfd=False: no duplicate of ``fd`` kept by the mapping: one descriptor per buffer, not two
    buf = Sealed(fd, size, flags=mmap.MAP_SHARED, prot=prot, **({"trackfd": False} if TRACKFD else {}))
    buf.fd = fd
    buf.sealed = not writable
    buf.closer = weakref.finalize(buf, _close, fd)  # gives the count of ``capacity.take`` back
    return buf


def new_buffer(size: int) -> Sealed | bytearray:
    """A zero-filled writable buffer of ``size`` bytes; OSError when no descriptor or memory is
    left (the caller degrades: the copy is not kept)."""
    if size == 0 or not can_share():
        return bytearray(size)
    capacity.take()  # OSError past the cap on held objects (descriptors, mappings)
    try:
        fd = os.memfd_create("ckptd-tier", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except BaseException:
        capacity.release()
        raise
    try:
        os.ftruncate(fd, size)
        return _adopt(fd, size, writable=True)
    except BaseException:
        _close(fd)
        raise


def seal(buf: Sealed | bytearray) -> Sealed | bytearray:
    """The read-only, sealed form of a filled ``new_buffer`` (a ``bytearray`` is returned as it is).
    ``buf`` must not be used afterwards."""
    if not isinstance(buf, Sealed) or buf.sealed:
        return buf
    import fcntl

    size = len(buf)
    fd = os.dup(buf.fd)
    try:
        buf.close()  # the writable mapping: F_SEAL_WRITE is refused while one exists
        fcntl.fcntl(fd, F_ADD_SEALS, SEALS)
        out = _adopt(fd, size, writable=False)
    except BaseException:
        os.close(fd)
        raise
    buf.closer.detach()  # the sealed buffer holds the count now; the writable one's descriptor goes
    os.close(buf.fd)
    return out
