"""Direct I/O (``O_DIRECT``) writes of large objects, past the page cache.

A buffered write copies the bytes into the page cache, whose pages the kernel must then find
(reclaiming others once the cache is full, as it is after a while of checkpoints), write back on
``syncfs`` and keep: for a checkpoint nobody on this host reads again soon, overhead whose cost
swings with whatever else the cache is doing (DeepSpeed's FastPersist makes the same choice).
The kernel takes a direct write only from an aligned address, at an aligned file offset, in
whole blocks. A source region that starts page-aligned at an aligned file position (a snapshot's
object image, see ``trainer_hooks.snapshot``) goes to the disk straight from the caller's
memory: no copy, and only a few percent of a core for 1.5 GiB. Everything else (views with
arbitrary addresses; a shard's chunks interleaved with their 4-byte checksums) goes through a
small page-aligned bounce buffer. The last block is padded and the file truncated to its size;
the padding lies past the end of the file and is never visible.

Bounce buffers come from a small shared pool (``DIRECT_BUFFERS`` of ``DIRECT_BUFFER_BYTES``),
allocated on first use and kept: the host memory it adds is bounded and does not grow with the
checkpoint. Durability is unchanged: the caller still fsyncs the file, or syncfs's the
filesystem, which also covers the file's size and the device's cache.

A filesystem that refuses ``O_DIRECT`` (``EINVAL`` on open or on an aligned write) makes the
caller fall back to buffered writes, for good on that store.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import queue
import threading
from collections.abc import Iterator

import numpy as np

ALIGN = 4096  # covers 512-byte and 4 KiB logical blocks
DIRECT_MIN_BYTES = 1 << 20  # smaller objects go through the page cache
DIRECT_BUFFER_BYTES = 1 << 20
DIRECT_BUFFERS = 4


class DirectUnsupported(OSError):
    """The filesystem refused O_DIRECT: write this object (and later ones) buffered."""


class BouncePool:
    """At most ``count`` page-aligned buffers of ``size`` bytes, lent one per writing thread."""

    def __init__(self, size: int = DIRECT_BUFFER_BYTES, count: int = DIRECT_BUFFERS):
        if size % ALIGN:
            raise ValueError(f"bounce buffer size must be a multiple of {ALIGN}, got {size}")
        self.size = size
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(count)

    @contextlib.contextmanager
    def lend(self) -> Iterator[mmap.mmap]:
        with self._slots:
            try:
                buf = self._free.get_nowait()
            except queue.Empty:
                buf = mmap.mmap(-1, self.size)  # anonymous maps are page-aligned
            try:
                yield buf
            finally:
                self._free.put(buf)


def open_direct(path: str, dir_fd: int | None = None) -> int:
    """Create ``path`` (exclusively, never through a link; relative to ``dir_fd`` when given) for
    direct writes; DirectUnsupported if the filesystem has no O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        raise DirectUnsupported(errno.EINVAL, "O_DIRECT is not available on this platform")
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT
        return os.open(path, flags, 0o644, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise DirectUnsupported(e.errno, f"O_DIRECT refused: {e.strerror}") from None
        raise


def write_direct(fd: int, views: list[memoryview], pool: BouncePool) -> int:
    """Write the concatenation of ``views`` at the start of ``fd`` (opened by ``open_direct``),
    from the views themselves where aligned, then truncate the file to the data's size; returns
    that size."""
    total = sum(v.nbytes for v in views)
    pos = 0  # file offset of the bounce buffer's first byte
    with pool.lend() as buf:
        bounce = np.frombuffer(buf, dtype=np.uint8)
        fill = 0
        for v in views:
            if not v.nbytes:
                continue
            src = np.frombuffer(v, dtype=np.uint8)
            addr = src.ctypes.data
            off = 0
            while off < v.nbytes:
                whole = (v.nbytes - off) // ALIGN * ALIGN
                if fill == 0 and whole and (addr + off) % ALIGN == 0:
                    pos += _write_block(fd, memoryview(src[off : off + whole]), pos)  # zero-copy
                    off += whole
                    continue
                n = min(v.nbytes - off, pool.size - fill)
                bounce[fill : fill + n] = src[off : off + n]  # numpy copies without the GIL
                fill += n
                off += n
                if fill == pool.size:
                    pos += _write_block(fd, memoryview(buf)[:fill], pos)
                    fill = 0
        if fill:
            pos += _write_block(fd, memoryview(buf)[: -(-fill // ALIGN) * ALIGN], pos)
    os.ftruncate(fd, total)
    return total


def _write_block(fd: int, mv: memoryview, pos: int) -> int:
    """Write all of ``mv`` (aligned address and length) at ``pos``; returns its length."""
    n = mv.nbytes
    try:
        done = 0
        while done < n:
            k = os.pwrite(fd, mv[done:], pos + done)
            if k <= 0 or k % ALIGN:
                # A short direct write leaves an unaligned position no further direct write can
                # continue from; the caller rewrites the object buffered.
                raise DirectUnsupported(errno.EIO, f"short direct write ({k} of {n - done} bytes)")
            done += k
    except OSError as e:
        if e.errno == errno.EINVAL and not isinstance(e, DirectUnsupported):
            raise DirectUnsupported(e.errno, f"O_DIRECT write refused: {e.strerror}") from None
        raise
    finally:
        mv.release()
    return n
