"""Exchange the contents of two tensors of one shape: by swapping their storages' memory when
that is safe, else by copying through a small scratch buffer.

The default (transactional) restore reads a checkpoint into fresh buffers; once every read and
check succeeded on every rank it exchanges each buffer with its live tensor, applies the state,
and on a failure exchanges them back. ``exchange`` swaps the two storages' data pointers
(``UntypedStorage._swap_data_ptr_``, a private torch method: every tensor, view and parameter
over either storage sees the other's bytes at once) -- no byte copied, and the undo is as free.
This module is the one place that calls it; ``tests/unit/test_storage_swap.py`` pins its
behaviour, and without it everything is copied.

A swapped live tensor must not keep the buffer's memory, though: that memory is freed with the
buffer, and raw pointers into the old memory (a ``numpy()`` view, a ``memoryview``, a
``ctypes`` address) would dangle. So once the state is applied, ``settle`` swaps the pointers
back and copies the restored bytes into the tensor's own memory: one memcpy per tensor, against
three (with a scratch buffer the size of a tensor) for an exchange by copying.

Memory is swapped only for tensors on the CPU, contiguous, each covering its whole storage, of
the same dtype and shape, whose storage is neither shared with other processes (a
``share_memory_`` tensor, a file mapped with ``shared=True``) nor pinned. The rest is
exchanged by copying, through a 64 KiB scratch buffer on the CPU.
"""

from __future__ import annotations

from concurrent.futures import Executor

import torch

from trainer_hooks.hostcopy import copy_all

__all__ = ["can_swap_memory", "exchange", "settle"]

_SWAP = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)
_bump = getattr(torch.autograd.graph, "increment_version", lambda t: None)

# Elements per copy in a CPU exchange by copying: 64 KiB stays in cache, and under torch's
# parallel grain (32768 elements), whose thread hand-offs cost more than they save here.
_BLOCK_BYTES = 1 << 16


def _whole(t: torch.Tensor) -> bool:
    """``t`` is contiguous and its bytes are exactly its storage's."""
    return (
        t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def can_swap_memory(live: torch.Tensor, fresh: torch.Tensor) -> bool:
    """Whether ``exchange(live, fresh)`` may swap memory (no copy) rather than copy."""
    if _SWAP is None or type(live) is not torch.Tensor or type(fresh) is not torch.Tensor:
        return False
    if live.device.type != "cpu" or fresh.device.type != "cpu" or live.numel() == 0:
        return False
    if live.dtype != fresh.dtype or live.shape != fresh.shape:
        return False
    if not (_whole(live) and _whole(fresh)):
        return False
    if live.is_shared() or fresh.is_shared() or live.is_pinned() or fresh.is_pinned():
        return False
    return live.untyped_storage().data_ptr() != fresh.untyped_storage().data_ptr()


def exchange(a: torch.Tensor, b: torch.Tensor, memory: bool) -> None:
    """Exchange the contents of ``a`` and ``b`` (same shape and dtype): by swapping their
    storages' memory if ``memory`` (the caller checked ``can_swap_memory``), else by copying.
    An involution: the same call again puts both back, also after other exchanges on the same
    storages when those are undone in reverse order."""
    if memory:
        a.untyped_storage()._swap_data_ptr_(b.untyped_storage())
        # Autograd checks saved tensors against their version counters: count the exchange as
        # the in-place write it stands for.
        _bump(a)
        _bump(b)
        return
    with torch.no_grad():
        if a.device.type != "cpu" or a.dim() == 0 or not (a.is_contiguous() and b.is_contiguous()):
            tmp = a.clone()
            a.copy_(b)
            b.copy_(tmp)
            return
        fa, fb = a.view(-1), b.view(-1)
        rows = max(1, _BLOCK_BYTES // a.element_size())
        tmp = torch.empty(min(rows, fa.numel()), dtype=a.dtype)
        for i in range(0, fa.numel(), rows):
            x, y = fa[i : i + rows], fb[i : i + rows]
            t = tmp[: x.numel()]
            t.copy_(x)
            x.copy_(y)
            y.copy_(t)


def settle(pairs: list[tuple[torch.Tensor, torch.Tensor, bool]], pool: Executor | None = None) -> None:
    """After a successful apply: for every ``(live, buffer, memory)`` exchanged in this order,
    give each live tensor its own memory back, holding the restored bytes (the buffers keep the
    old ones). Pairs exchanged by copying are done already. Pointers are swapped back in
    reverse order; then each live storage receives the bytes of the *last* buffer exchanged with
    it (every exchange covers the whole storage), as the sequence of copies would leave it. The
    copy is ``hostcopy.copy_all`` on ``pool``: one ``copy_`` per tensor stalls on a busy machine
    (1.3 s instead of 0.13 s for 1.5 GiB here with two other busy processes)."""
    moved = [(live, buf) for live, buf, memory in pairs if memory]
    for live, buf in reversed(moved):
        exchange(live, buf, True)
    last = {live.untyped_storage().data_ptr(): (live, buf) for live, buf in moved}
    copy_all(list(last.values()), pool)
    for live, _ in last.values():
        _bump(live)  # a write, as far as autograd's saved tensors are concerned
