"""The job roots below a served root, for the status page and ``GET /v1/job-roots``.

``ckptd serve --root s3://bucket/jobs`` serves every job root below it (``.../jobs/run-42``), but
a daemon learns of one only when a trainer hands a save off; after a node failure a fresh daemon
knew of none. So the roots are found in storage: a *job root* is a folder that holds step folders
(``step_`` + 10 digits). The scan lists folders breadth first from the served root, never goes
into a job root (its folders are steps) nor into ``_``/``.`` folders, and is bounded: at most
``MAX_DEPTH`` levels below the served root and ``MAX_FOLDERS`` listings per scan (``truncated``
says when it stopped early). Results are cached ``TTL_S`` seconds per served root, so a page
refreshing every two seconds costs one scan per half minute.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from ckptd.errors import CheckpointError
from ckptd.manifest import parse_step_dir
from storage_backends import StorageError, Store

__all__ = ["Found", "JobRoots", "MAX_DEPTH", "MAX_FOLDERS", "one_per_daemon", "scan", "shared"]

MAX_DEPTH = 3
MAX_FOLDERS = 512
TTL_S = 30.0


@dataclass(frozen=True)
class Found:
    roots: tuple[str, ...]  # job root URIs, sorted
    truncated: bool  # the scan stopped at MAX_FOLDERS listings: some folders were not looked at
    time: float


def scan(store: Store, base: str, max_depth: int = MAX_DEPTH, max_folders: int = MAX_FOLDERS) -> Found:
    """The job roots at or below ``base`` (whose ``store`` is given). Raises CheckpointError
    when storage does not answer the first listing."""
    found: list[str] = []
    queue: deque[tuple[str, int]] = deque([("", 0)])
    listed = 0
    while queue and listed < max_folders:
        rel, depth = queue.popleft()
        try:
            _, dirs = store.list_dir(rel)
        except (StorageError, ValueError) as e:  # ValueError: a folder name that is no valid key
            if not rel:
                raise CheckpointError(f"{base}: cannot list the root ({e})") from None
            continue  # a folder that vanished or is unreadable: not a job root we can show
        listed += 1
        if any(parse_step_dir(d) is not None for d in dirs):
            found.append(f"{base.rstrip('/')}/{rel.strip('/')}" if rel else base)
            continue
        if depth < max_depth:
            queue.extend((f"{rel}{d}/", depth + 1) for d in dirs if not d.startswith(("_", ".")))
    return Found(tuple(sorted(found)), bool(queue), time.time())  # truncated: folders left unlisted


class JobRoots:
    """``scan`` per served root, cached ``TTL_S`` seconds; safe to call from any thread."""

    def __init__(self, runner, ttl_s: float = TTL_S):
        self.runner = runner
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._cache: dict[str, Found] = {}

    def get(self, base: str) -> Found:
        now = time.time()
        with self._lock:
            hit = self._cache.get(base)
        if hit is not None and now - hit.time < self.ttl_s:
            return hit
        found = scan(self.runner.store(base), base)
        with self._lock:
            self._cache[base] = found
        return found


_SHARED = threading.RLock()


def one_per_daemon(state, name: str, make):
    """``state.<name>`` (``app.state``), made by ``make()`` at the first call, whatever the thread."""
    with _SHARED:
        if getattr(state, name, None) is None:
            setattr(state, name, make())
        return getattr(state, name)


def shared(state) -> JobRoots:
    """The daemon's one ``JobRoots``, for the API and the status page alike."""
    return one_per_daemon(state, "job_roots", lambda: JobRoots(state.daemon.runner))
