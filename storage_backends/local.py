"""A store on a local or network filesystem: one file per key under a root folder.

Durability and atomicity follow the usual recipe: every write goes to a temp file in the target's
own folder (``.{name}.tmp.{pid}.{thread}.{random}``), is fsynced, then renamed (``put``) or
hard-linked (``put_if_absent``) into place, and the folder is fsynced so the new name survives
a crash. Temp files are never listed; a crash may leave one behind, which is harmless.

Objects are never modified in place (a ``put`` replaces the inode), which is what makes
``copy`` by hard link safe.

Objects of 1 MiB or more are written with ``O_DIRECT`` (``storage_backends._direct`` says why),
unless ``CKPTD_DIRECT_IO=0`` or the filesystem refuses it; durability is the same either way.

Here: ``LocalStore``'s writes; its reads and listings are ``_local_reads``, its deletes
``_local_purge``, and the descriptor-relative primitives they share ``_local_fs``.

``owner``: a function naming the (uid, gid) that what the store makes belongs to, or None. Each
file and folder it makes is then given to them (``fchown`` and ``fchmod`` on a descriptor opened
``O_NOFOLLOW``, before the file is renamed into place), files 0640 and folders 0750: no world
bits. A daemon writing a tenant's root as root uses it (``ckptd.server.tenancy``). uid -1: the
writer keeps the files (it cannot give them away) and gives them the group only, files 0640 and
folders 2770, so that group (the tenant's and the writer's, who share the root folder) can delete
and move what the writer made; a group the writer is not in is refused (``StorageError``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterator, Sequence

from storage_backends._direct import DIRECT_MIN_BYTES, BouncePool, DirectUnsupported, open_direct, write_direct
from storage_backends._local_fs import (
    DIR_OPEN,
    DIR_RACE_TRIES,
    FILE_OPEN,
    NEW_FILE,
    NO_LINK_ERRNOS,
    copy_file,
    gone,
    identity,
    syncfs,
    walk_down,
    write_temp,
    writev_all,
)
from storage_backends._local_purge import Deletes
from storage_backends._local_reads import Reads
from storage_backends.base import Data, ExistsError, NotFoundError, StorageError, Store, as_buffers, check_key

__all__ = ["LinkRefused", "LocalStore"]

log = logging.getLogger("ckptd")


class LinkRefused(StorageError):
    """A write met a symbolic link (or a non-folder) below the store's root: refused, never followed."""


class LocalStore(Reads, Deletes, Store):
    """``/abs/path`` or ``file:///abs/path``. A missing root is an empty store; puts create it.

    Thread- and process-safe (the recipe above): readers see one whole version, and exactly one
    ``put_if_absent`` wins, even across hosts on a POSIX network filesystem.

    Nothing below the root is followed through a symbolic link (the root itself may be one; how:
    ``_local_fs``). So a step folder that is a link to elsewhere, planted in a root someone else
    can write, reads as absent, is never written through (``LinkRefused``) and is never deleted
    through; a FIFO or a device file is not an object.
    """

    def __init__(
        self,
        root: str,
        direct_io: bool | None = None,
        *,
        below: str | None = None,
        owner: Callable[[], tuple[int, int] | None] | None = None,
    ) -> None:
        """``below``: a folder the root lies inside (a daemon's served root, the root a request
        named below it). Then only ``below`` itself may be a link: every folder from it down to the
        root is opened (or made) one level at a time with ``O_NOFOLLOW``, so a link planted on the
        way (``served/link/theirjob``) is never followed, for reads, writes and deletes alike."""
        self.root = os.path.abspath(root)
        self.uri = self.root
        self._below: str | None = None
        self._below_parts: tuple[str, ...] = ()
        if below is not None:
            base = os.path.abspath(below)
            rel = os.path.relpath(self.root, base)
            if rel == os.pardir or rel.startswith(os.pardir + os.sep):
                raise StorageError(f"{self.root} is not inside {base}")
            self._below = base
            self._below_parts = tuple(p for p in rel.split(os.sep) if p not in ("", os.curdir))
        # Folders made by put_deferred, durable after the next sync (or the next durable put below
        # them, which fsyncs their parents first).
        self._deferred_dirs: set[str] = set()
        self._dirs_lock = threading.Lock()
        self._direct = direct_io if direct_io is not None else os.environ.get("CKPTD_DIRECT_IO", "1") != "0"
        self._bounce = BouncePool()
        self._owner = owner

    # -- helpers ----------------------------------------------------------------------------------

    def _fail(self, op: str, what: str, e: OSError, hint: str = "") -> StorageError:
        return StorageError(f"{self.uri}: {op} {what} failed: {e.strerror or e} (errno {e.errno}){hint}")

    def _err(self, op: str, key: str, e: OSError) -> StorageError:
        """For reads: a missing file (or a folder, a link, a non-folder on the way) is NotFoundError."""
        if gone(e):
            return NotFoundError(f"{self.uri}: no object {key!r}")
        return self._fail(op, repr(key), e)

    def _dir_fd(self, parts: Sequence[str], create: bool = False, durable: bool = True) -> int:
        """A descriptor of the folder ``root/parts...``, each level opened ``O_NOFOLLOW`` from its
        parent's descriptor. ``create``: missing levels are made (with the root), their names made
        durable (fsync of the parent) unless ``durable=False``, which leaves that to ``sync``.
        Raises OSError: ENOENT for a missing level, ELOOP/ENOTDIR for a link or a file."""

        def made(parent: int, depth: int, missing: bool) -> None:
            if missing:
                self._own(parent, parts[depth - 1], folder=True)
            if missing and durable:
                os.fsync(parent)
            elif missing or (durable and self._deferred_dirs):
                path = "/".join((self.root, *parts[:depth]))
                if missing:
                    with self._dirs_lock:
                        self._deferred_dirs.add(path)
                elif path in self._deferred_dirs:
                    os.fsync(parent)  # a deferred put made it: make its name durable now
                    with self._dirs_lock:
                        self._deferred_dirs.discard(path)

        return walk_down(self._root_fd(create), parts, create, made)

    def _root_fd(self, create: bool = False) -> int:
        """A descriptor of the root folder. The root itself may be a link, unless the store was
        made with ``below``: then only that folder may be, and each level under it is opened (or
        made, durably) with ``O_NOFOLLOW``; a link there raises OSError ELOOP or ENOTDIR."""
        top = self.root if self._below is None else self._below
        try:
            fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            if not create:
                raise
            os.makedirs(top, exist_ok=True)
            fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

        def made(parent: int, depth: int, missing: bool) -> None:
            if missing:
                self._own(parent, self._below_parts[depth - 1], folder=True)
                os.fsync(parent)

        return walk_down(fd, self._below_parts, create, made)

    def exists_root(self) -> bool:
        try:
            os.close(self._root_fd())
        except OSError:
            return False
        return True

    @contextlib.contextmanager
    def _parent(self, key: str, create: bool = False, durable: bool = True) -> Iterator[tuple[int, str]]:
        """(descriptor of the key's folder, the key's file name), closed on exit."""
        *folders, name = check_key(key).split("/")
        fd = self._dir_fd(folders, create, durable)
        try:
            yield fd, name
        finally:
            os.close(fd)

    def _write_error(self, op: str, key: str, e: OSError, hint: str = "") -> StorageError:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            return LinkRefused(
                f"{self.uri}: {op} {key!r} refused: a symbolic link or a file is in the way below the root "
                "(links are never followed)"
            )
        return self._fail(op, repr(key), e, hint)

    def _own(self, dir_fd: int, name: str, folder: bool) -> None:
        """Give ``name`` (just made in ``dir_fd``) to the store's owner, if it has one."""
        who = self._owner() if self._owner is not None else None
        if who is None:
            return
        uid, gid = who
        fd = os.open(name, DIR_OPEN if folder else FILE_OPEN, dir_fd=dir_fd)
        try:
            os.fchown(fd, uid, gid)
            os.fchmod(fd, (0o750 if uid != -1 else 0o2770) if folder else 0o640)
        except PermissionError:
            raise StorageError(
                f"{self.uri}: cannot give {name!r} to uid {uid}, gid {gid}: "
                + ("this process is not in that group" if uid == -1 else "this process lacks CAP_CHOWN")
            ) from None
        finally:
            os.close(fd)

    @staticmethod
    def _tmp_name(name: str) -> str:
        # Truncated so the temp name stays under NAME_MAX (255) for long keys.
        return f".{name[:120]}.tmp.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}"

    def _make_temp(self, key: str, create: Callable[[int, str], None], durable: bool = True) -> tuple[int, str, str]:
        """(folder descriptor, temp name, key's name): a temp file in the key's folder (made
        durably as needed), filled by ``create(dir_fd, temp_name)``. The caller closes the fd."""
        for attempt in range(DIR_RACE_TRIES):
            with contextlib.ExitStack() as stack:
                *folders, name = check_key(key).split("/")
                try:
                    fd = self._dir_fd(folders, True, durable)
                    stack.callback(os.close, fd)
                    tmp = self._tmp_name(name)
                    create(fd, tmp)
                    try:
                        self._own(fd, tmp, folder=False)
                    except BaseException:
                        with contextlib.suppress(OSError):
                            os.unlink(tmp, dir_fd=fd)
                        raise
                except FileNotFoundError:
                    # A concurrent delete pruned the folder after we opened it (no file can be
                    # made in a removed folder): make it again.
                    if attempt == DIR_RACE_TRIES - 1:
                        raise
                    continue
                stack.pop_all()
                return fd, tmp, name
        raise AssertionError("unreachable")

    def _fill(self, views: list[memoryview], durable: bool = True) -> Callable[[int, str], None]:
        direct = self._direct and sum(v.nbytes for v in views) >= DIRECT_MIN_BYTES

        def create(dir_fd: int, tmp: str) -> None:
            if direct and self._direct:
                # O_DIRECT; if the filesystem refuses it (nothing is left behind), this store
                # writes buffered from now on.
                try:
                    fd = open_direct(tmp, dir_fd=dir_fd)
                    return write_temp(dir_fd, tmp, fd, lambda fd: write_direct(fd, views, self._bounce), durable)
                except DirectUnsupported as e:
                    if self._direct:
                        self._direct = False
                        log.info("%s: writing through the page cache (%s)", self.root, e)
            fd = os.open(tmp, NEW_FILE, 0o644, dir_fd=dir_fd)
            write_temp(dir_fd, tmp, fd, lambda fd: writev_all(fd, views), durable)

        return create

    def _prune(self, folders: Sequence[str]) -> None:
        """Remove empty folders from ``root/folders`` up to (not including) the root, best-effort,
        each by name from its parent's descriptor."""
        folders = list(folders)
        while folders:
            try:
                fd = self._dir_fd(folders[:-1])
            except OSError:
                return
            try:
                os.rmdir(folders[-1], dir_fd=fd)
            except OSError:
                return
            finally:
                os.close(fd)
            folders.pop()

    # -- writes (reads, listings: _local_reads; deletes: _local_purge) -------------------------

    def put(self, key: str, data: Data) -> None:
        self._put(key, data, durable=True)

    def put_deferred(self, key: str, data: Data) -> None:
        """Not fsynced: many small fsyncs (each file, each folder) cost far more than the one
        ``syncfs`` of ``sync``."""
        self._put(key, data, durable=False)

    def sync(self) -> None:
        """Make every earlier ``put_deferred`` durable: ``syncfs(2)`` on the root's filesystem
        (all dirty data and metadata of that filesystem), falling back to ``sync(2)``."""
        try:
            fd = self._root_fd()
        except OSError:
            return
        with self._dirs_lock:
            pending = set(self._deferred_dirs)
        try:
            if syncfs is None or syncfs(fd) != 0:
                os.sync()
        finally:
            os.close(fd)
        with self._dirs_lock:
            self._deferred_dirs -= pending

    def _put(self, key: str, data: Data, durable: bool) -> None:
        views = as_buffers(data)
        try:
            fd, tmp, name = self._make_temp(key, self._fill(views, durable), durable)
            try:
                self._replace(fd, tmp, name, durable)
            finally:
                os.close(fd)
        except OSError as e:
            raise self._write_error("put", key, e) from None

    def put_if_absent(self, key: str, data: Data) -> bool:
        return self._link_new("put_if_absent", key, data, durable=True) is not None

    def put_new(self, key: str, data: Data) -> tuple[int, int, int, int]:
        """Create-only (``_link_new``: never renamed over the key), durable at the next ``sync``.
        Returns the file's identity for ``delete_if`` (``_local_fs.identity``)."""
        st = self._link_new("put_new", key, data, durable=False)
        if st is None:
            raise ExistsError(f"{self.uri}: {key!r} exists; a create-only write never replaces it")
        return identity(st)

    def _link_new(self, op: str, key: str, data: Data, durable: bool) -> os.stat_result | None:
        """Write a temp file and hard-link it to the key's name: the stat of the file if this
        call created the name, None if it was taken. link(2) is the atomic create-if-absent of
        POSIX: it fails with EEXIST if the name exists (a link too), and the new name appears
        with the complete content (fsynced, with its name, when ``durable``)."""
        try:
            fd, tmp, name = self._make_temp(key, self._fill(as_buffers(data), durable), durable)
            try:
                try:
                    st = os.stat(tmp, dir_fd=fd, follow_symlinks=False)
                    os.link(tmp, name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    return None
                finally:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=fd)
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            hint = " (the filesystem does not support hard links)" if e.errno in NO_LINK_ERRNOS else ""
            raise self._write_error(op, key, e, hint) from None
        return st

    def delete_if(self, key: str, tag: object) -> bool:
        """Rename the name aside to a temp name of our own, check the file's identity there,
        unlink it if it is ``tag``, else link it back (create-only) and drop the aside name: no
        other writer's file is ever removed, even one that took the key a moment ago. (An aside
        name a crash leaves behind is a temp file: ``purge`` removes it.)"""
        if not isinstance(tag, tuple) or len(tag) != 4:
            return False
        try:
            with self._parent(key) as (dfd, name):
                aside = self._tmp_name(name)
                os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)  # gone: False, below
                st = os.stat(aside, dir_fd=dfd, follow_symlinks=False)
                ours = identity(st) == tag and stat.S_ISREG(st.st_mode)
                if not ours:
                    try:
                        os.link(aside, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                    except FileExistsError:
                        log.warning("%s: %r was taken again while checking it; left %r aside", self.uri, key, aside)
                        return False
                os.unlink(aside, dir_fd=dfd)
                os.fsync(dfd)
        except OSError as e:
            if gone(e):
                return False
            raise self._fail("delete_if", f"{key!r}", e) from None
        if ours:
            self._prune(check_key(key).split("/")[:-1])
        return ours

    def copy(self, src_key: str, dst_key: str) -> None:
        try:
            with self._parent(src_key) as (sfd, sname):
                st = os.stat(sname, dir_fd=sfd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    raise FileNotFoundError(errno.ENOENT, "not a regular file")

                def create(dfd: int, tmp: str) -> None:
                    try:
                        # A hard link costs no data copy and is safe because objects are immutable.
                        os.link(sname, tmp, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
                    except OSError as e:
                        if e.errno not in NO_LINK_ERRNOS:
                            raise
                        copy_file(sfd, sname, dfd, tmp)

                fd, tmp, name = self._make_temp(dst_key, create)
                try:
                    self._replace(fd, tmp, name)
                finally:
                    os.close(fd)
        except OSError as e:
            if gone(e) and not self.exists(src_key):
                raise NotFoundError(f"{self.uri}: no object {src_key!r}") from None
            raise self._write_error("copy", f"{src_key} -> {dst_key}", e) from None

    def _replace(self, dir_fd: int, tmp: str, name: str, durable: bool = True) -> None:
        """Rename the complete temp file over ``name`` and make the new name durable."""
        try:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        if durable:
            os.fsync(dir_fd)
