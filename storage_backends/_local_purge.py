"""The local store's deletes: one object, a prefix (``purge``), and stale temp files.

Invariants: every name is removed from its parent's descriptor and no link is followed (a link
is neither an object nor a folder of this store, and is never deleted through); beyond the
listed objects only temp files (by name) and empty folders are removed, so anything else left in
a folder keeps it; folders are fsynced once each after their files went (not once per file),
deepest first so pruning empties parents.

``Deletes`` is a mixin of ``LocalStore`` (``storage_backends.local``) and uses its helpers.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time

from storage_backends._local_fs import enter, entries, gone, is_temp
from storage_backends.base import check_dir_prefix

__all__ = ["Deletes"]


class Deletes:
    """delete, purge (and so ``delete_prefix``) and abort_stale_uploads of ``LocalStore``."""

    def delete(self, key: str) -> None:
        if self._unlink(key, durable=True):
            self._prune(key.split("/")[:-1])  # _parent checked the key

    def _unlink(self, key: str, durable: bool) -> bool:
        """Unlink the object's name (a link itself, never followed; its folder fsynced if
        ``durable``); False if there was none (a folder or a link on the way is none either)."""
        try:
            with self._parent(key) as (dfd, name):
                os.unlink(name, dir_fd=dfd)
                if durable:
                    os.fsync(dfd)
        except OSError as e:
            if gone(e):
                return False
            raise self._fail("delete", f"{key!r}", e) from None
        return True

    def purge(self, prefix: str) -> tuple[int, int]:
        """Objects first (the listing readers use), then what a killed writer left that no
        listing shows: ``.*.tmp.*`` files and empty folders. Returns (files, bytes) removed."""
        n = nbytes = 0
        dirs: set[tuple[str, ...]] = set()
        for info in list(self.list(prefix)):
            if self._unlink(info.key, durable=False):
                n += 1
                nbytes += info.size
                dirs.add(tuple(info.key.split("/")[:-1]))
        folder, _, name_prefix = prefix.rpartition("/")
        top = tuple(folder.split("/")) if folder else ()
        try:
            m, mbytes, emptied = self._purge_leftovers(prefix, top, name_prefix)
        except OSError as e:
            raise self._fail("delete", f"{prefix!r}", e) from None
        n, nbytes = n + m, nbytes + mbytes
        dirs |= emptied
        if folder and not name_prefix:
            dirs.add(top)  # the prefix names a folder: remove it too once empty
        # One fsync per folder instead of one per file; deepest folders first so pruning works.
        for d in sorted(dirs, key=len, reverse=True):
            with contextlib.suppress(OSError):
                fd = self._dir_fd(d)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            self._prune(d)
        return n, nbytes

    def abort_stale_uploads(self, older_than: float, prefix: str = "") -> list[str]:
        """A filesystem's incomplete uploads are the temp files of writes that never finished
        (their writer was killed between writing and renaming, or between the link and the
        unlink of ``put_if_absent``): remove those last modified more than ``older_than``
        seconds ago, anywhere under the folder ``prefix`` of the root (all of it by default), even
        inside committed steps, which ``purge`` never touches. Returns their paths."""
        check_dir_prefix(prefix)
        top = tuple(p for p in prefix.split("/") if p)
        cutoff = time.time() - older_than
        removed: list[str] = []

        def walk(dfd: int, where: tuple[str, ...]) -> None:
            for name, is_dir in entries(dfd):
                if is_dir:
                    enter(dfd, name, lambda child, name=name: walk(child, (*where, name)))
                elif is_temp(name):
                    with contextlib.suppress(FileNotFoundError):
                        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                        if st.st_mtime <= cutoff:
                            os.unlink(name, dir_fd=dfd)
                            removed.append("/".join((*where, name)))

        fd = self._folder(top, "list", prefix)
        if fd is None:
            return removed
        try:
            walk(fd, top)
        except OSError as e:
            raise self._fail("delete", "temp files", e) from None
        finally:
            os.close(fd)
        return sorted(removed)

    def _purge_leftovers(
        self, prefix: str, top: tuple[str, ...], name_prefix: str
    ) -> tuple[int, int, set[tuple[str, ...]]]:
        """Remove temp files named for keys under ``top``/``name_prefix`` and the empty folders
        there, walking by descriptors; returns (files, bytes, folders touched)."""
        counts = [0, 0]
        touched: set[tuple[str, ...]] = set()

        def unlink_temp(dfd: int, name: str, where: tuple[str, ...]) -> None:
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    return
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                return
            counts[0] += 1
            counts[1] += st.st_size if stat.S_ISREG(st.st_mode) else 0
            touched.add(where)

        def tree(dfd: int, where: tuple[str, ...]) -> None:
            """Temp files and empty sub-folders of the folder ``dfd`` (links never entered)."""
            for name, is_dir in entries(dfd):
                if is_dir:
                    sub(dfd, name, where)
                elif is_temp(name):
                    unlink_temp(dfd, name, where)

        def sub(dfd: int, name: str, where: tuple[str, ...]) -> None:
            """The sub-folder ``name`` of ``dfd``: its tree, then itself if that left it empty."""
            if not enter(dfd, name, lambda child: tree(child, (*where, name))):
                return  # gone, or replaced by a link: not ours to enter
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=dfd)  # fails unless empty: then something else lives there
                touched.add(where)

        fd = self._folder(top, "delete", prefix)
        if fd is None:
            return 0, 0, touched
        try:
            for name, is_dir in entries(fd):
                if is_temp(name):
                    if name[1:].startswith(name_prefix):  # ".{name}.tmp..." of a key under the prefix
                        unlink_temp(fd, name, top)
                elif is_dir and name.startswith(name_prefix):
                    sub(fd, name, top)
        finally:
            os.close(fd)
        return counts[0], counts[1], touched
