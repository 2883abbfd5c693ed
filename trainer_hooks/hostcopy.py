"""Copy many CPU tensors at memory bandwidth, also on a busy machine.

A save's snapshot and a restore's settle copy hundreds of tensors. One ``Tensor.copy_`` per
tensor is one OpenMP parallel region each, which ends only when every OpenMP thread has run its
share: on a machine whose cores are busy with other processes, each region waits for a
descheduled thread, once per tensor (a 2-core VM at load 4.5, 300 tensors of 1.5 GiB: 0.56-0.61 s
by ``copy_``, 0.25 s by ``copy_all``).

``copy_all`` cuts every pair into pieces of at most ``PIECE_BYTES`` along the first dimension;
at most ``COPIERS`` tasks on a thread pool take the next uncopied piece until none is left, each
copying with ``numpy.copyto`` (a strided memcpy that releases the GIL). A busy core then slows
the copy in proportion instead of stalling it per tensor, and a descheduled task leaves its share
to the others (1.5 GiB, quiet, median of 8: 0.156 s against 0.165 s with a fixed split).

``prefaulting``: one thread faults in the pages of fresh buffers ahead of the many reader
threads that fill them (the default restore's), in the order they are read. Sixteen readers
each faulting 4 KiB pages inside ``preadv`` contend in the kernel (1.5 GiB restore, 2-core VM,
cold, median of 5: 1.59 s that way, 1.03 s with the pages faulted ahead).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import itertools
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, wait

import numpy as np
import torch

__all__ = ["copy_all", "populate", "prefaulting"]

PIECE_BYTES = 8 << 20
COPIERS = 4

# numpy has no bfloat16 or float8: a tensor is copied as integers of its element size.
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _numpy(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view of ``t``'s elements (strides kept), or None where there is none."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        return None
    as_int = _AS_INT.get(t.element_size())
    try:
        return (t.view(as_int) if as_int is not None else t).numpy()
    except (RuntimeError, TypeError):
        return None


def copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]], pool: Executor | None) -> None:
    """``dst.copy_(src)`` for every ``(dst, src)``: CPU tensors of one shape and dtype each,
    no two destinations overlapping. Returns when every byte is copied; raises the first error."""
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    for dst, src in pairs:
        d, s = _numpy(dst), _numpy(src)
        if d is None or s is None or d.shape != s.shape or d.dtype != s.dtype:
            with torch.no_grad():
                dst.copy_(src)
            continue
        if d.ndim == 0 or d.nbytes <= PIECE_BYTES:
            pieces.append((d, s))
            continue
        rows = max(1, PIECE_BYTES // max(1, d.nbytes // d.shape[0]))
        pieces += [(d[i : i + rows], s[i : i + rows]) for i in range(0, d.shape[0], rows)]
    copiers = min(COPIERS, os.cpu_count() or 1, len(pieces))
    if pool is None or copiers < 2:
        _copy(pieces, itertools.count())
        return
    taken = itertools.count()  # the next piece to copy: next() on it is atomic under the GIL
    futures = [pool.submit(_copy, pieces, taken) for _ in range(copiers)]
    wait(futures)  # all of them, also when one failed: nothing copies after the return
    for f in futures:
        f.result()


def _copy(pieces: list[tuple[np.ndarray, np.ndarray]], taken: Iterator[int]) -> None:
    for i in taken:
        if i >= len(pieces):
            return
        np.copyto(*pieces[i])


# ---------------------------------------------------------------------------------- prefaulting
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable without writing them
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_unsupported = sys.platform != "linux"


@functools.cache
def _libc_madvise():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _ranges(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Whole pages inside each CPU tensor's bytes, in ``PIECE_BYTES`` pieces, in order."""
    out = []
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            continue
        p, n = t.data_ptr(), t.numel() * t.element_size()
        start, stop = -(-p // _PAGE) * _PAGE, (p + n) // _PAGE * _PAGE
        out += [(a, min(PIECE_BYTES, stop - a)) for a in range(start, stop, PIECE_BYTES)]
    return out


def populate(tensors: Sequence[torch.Tensor], stop: threading.Event | None = None) -> bool:
    """Fault in the pages of ``tensors`` (CPU, contiguous; others are skipped) without changing a
    byte, piece by piece in order, until done or ``stop`` is set. A hint: False where the kernel
    has no ``MADV_POPULATE_WRITE`` (or refuses a range), and the pages fault in when written."""
    global _unsupported
    fn = None if _unsupported else _libc_madvise()
    if fn is None:
        return False
    for addr, n in _ranges(tensors):
        if stop is not None and stop.is_set():
            return True
        if fn(addr, n, _MADV_POPULATE_WRITE) != 0:
            if ctypes.get_errno() == errno.EINVAL:  # a kernel before 5.14: never again
                _unsupported = True
            return False
    return True


@contextlib.contextmanager
def prefaulting(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """While the body runs, one thread faults in the pages of ``tensors`` (fresh buffers the body
    fills) in order, ahead of the body's writers; it stops when the body ends, and is joined
    before this returns, so it never touches a buffer freed afterwards. Contents are unchanged."""
    if _unsupported or not tensors:
        yield
        return
    stop = threading.Event()
    th = threading.Thread(target=populate, args=(list(tensors), stop), name="ckptd-prefault", daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()
