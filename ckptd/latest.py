"""Finding the newest committed step in a bounded number of requests, whatever the steps kept.

Listing the job root costs one request per 1000 steps on S3 and grows without bound. Instead,
the committed steps are reachable through a chain of small immutable objects, appended with
``put_if_absent`` only (plain S3 semantics: no rename, no compare-and-swap on contents)::

    _latest/first.json            the chain's first step (a JSON int)
    _latest/after_0000000100.json the next step after 100 in the chain (a JSON int), written once
    _latest/hint.json             a recent element of the chain (plain put; may be stale)

Rules:

- ``link(store, T)`` runs *before* step T's ``commit.json`` is created (by the rank that creates
  it). It walks the chain to its end E; if T > E it appends T (``put_if_absent`` of
  ``after_E``; on a lost race it follows the winner and tries again). So the chain is strictly
  increasing and every committed step is <= some element of the chain.
- ``latest_step(store)`` starts at the hint (else the chain's end) and takes the newest
  committed of the step folders listed after it (``Store.list_dir_after``: one request on S3),
  else the start: every committed step is after the start or at most the start. Nothing
  committed there, no chain, a walk or listing over ``MAX_WALK``, or a malformed value: it
  lists the root.
- ``set_hint`` after a successful commit moves the hint forward, so a read is 1 GET of the
  hint, 1 LIST of the folders after it (none, or a save in flight), and 1 HEAD of a commit record.
- Links are never deleted: retention removes checkpoints, never numbers of the chain (a few
  bytes per save). A deleted chain end reads as "not committed" and falls back to listing.

The chain is a hint, never the authority (anyone who can write the root can write
``_latest/``): a forged value only costs requests (``docs/security.md``, "The latest-step chain").

A root written by an older ckptd has no chain; the first commit by this version seeds
``first`` with the larger of its own step and the newest step found by listing. Every writer of
one root must then use this version (an older writer's commits are not linked and a reader
would miss them until a newer step is linked).
"""

from __future__ import annotations

import json

from ckptd.manifest import COMMIT, MAX_STEP, parse_step_dir, step_dir
from storage_backends import NotFoundError, StorageError, Store

LATEST = "_latest"
FIRST = f"{LATEST}/first.json"
HINT = f"{LATEST}/hint.json"
MAX_WALK = 64
MAX_VALUE_BYTES = 64  # a step is at most 10 digits; a hint or link longer than this is forged


def link_key(step: int) -> str:
    return f"{LATEST}/after_{step:010d}.json"


def _read_step(store: Store, key: str) -> int | None:
    """The step stored at ``key``; None if absent. A malformed value (over ``MAX_VALUE_BYTES``,
    not JSON, not a step of at most 10 digits) or an unreadable one raises ValueError: the
    chain then does not answer. A FIFO or a device in a local root reads as absent."""
    try:
        data = store.get(key, limit=MAX_VALUE_BYTES)
    except NotFoundError:
        return None
    except StorageError as e:  # over the cap (forged), or unreachable: the chain cannot answer
        raise ValueError(f"{key}: unreadable ({e})") from None
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        raise ValueError(f"{key}: not a step: {data[:40]!r}") from None
    if type(value) is not int or not 0 <= value <= MAX_STEP:
        raise ValueError(f"{key}: not a step: {data[:40]!r}")
    return value


def _hint(store: Store) -> int | None:
    """The hint, or None when it is absent or malformed (a hint is never worth failing for)."""
    try:
        return _read_step(store, HINT)
    except ValueError:
        return None


def _committed(store: Store, step: int) -> bool:
    return store.exists(f"{step_dir(step)}/{COMMIT}")


def link(store: Store, step: int, newest_by_listing) -> bool:
    """Make the chain reach ``step`` before its commit record is written. True if ``step`` is
    an element of the chain afterwards (then the hint may point at it once it is committed).

    ``newest_by_listing(store)`` is the newest committed step found by listing, used once per
    root to seed the chain of a root that has none."""
    cur = _hint(store)
    if cur is not None and cur > step:
        # A hint is a committed element of the chain, so ``step`` is below the end: not on it.
        # A hint above ``step`` that is not committed is forged (or its step was deleted):
        # start from the first element instead, so that saves are linked again.
        if _committed(store, cur):
            return False
        cur = None
    if cur is None:
        cur = _read_step(store, FIRST)
    if cur is None:
        base = newest_by_listing(store)
        first = step if base is None or step > base else base
        if store.put_if_absent(FIRST, str(first).encode()):
            return first == step
        cur = _read_step(store, FIRST)
        if cur is None:  # deleted under us: someone is resetting the root
            raise NotFoundError(f"{store.uri}: {FIRST} vanished while linking step {step}")
    for _ in range(10 * MAX_WALK):
        if step == cur:
            return True
        if step < cur:
            return False
        nxt = _read_step(store, link_key(cur))
        if nxt is None:
            if store.put_if_absent(link_key(cur), str(step).encode()):
                return True
            nxt = _read_step(store, link_key(cur))
        if nxt is None or nxt <= cur:
            raise ValueError(f"{store.uri}: {link_key(cur)} is malformed (next {nxt}, after {cur})")
        cur = nxt
    raise ValueError(f"{store.uri}: the chain of {LATEST} is longer than {10 * MAX_WALK} links from its start")


def set_hint(store: Store, step: int) -> None:
    """After ``step`` committed and ``link`` said it is on the chain."""
    store.put(HINT, str(step).encode())


def latest_from_chain(store: Store) -> tuple[bool, int | None]:
    """(True, newest committed step) when the chain answers; (False, None) when the caller must
    list (no chain, a malformed or too long walk, more than ``MAX_WALK`` step folders after the
    start, or nothing committed at or after it); how and why: the module docstring. Loops are
    bounded, never recursive."""
    try:
        cur = _hint(store)
        if cur is None:
            cur = _read_step(store, FIRST)
            for _ in range(MAX_WALK):
                if cur is None or (nxt := _read_step(store, link_key(cur))) is None:
                    break
                if nxt <= cur:
                    return False, None
                cur = nxt
            else:
                return False, None
    except ValueError:
        cur = None
    if cur is None:
        return False, None
    _, folders = store.list_dir_after("", step_dir(cur))
    later = [s for f in folders if (s := parse_step_dir(f)) is not None and s > cur]
    if len(later) > MAX_WALK:
        return False, None
    newest = next((s for s in [*sorted(later, reverse=True), cur] if _committed(store, s)), None)
    return newest is not None, newest


__all__ = [
    "FIRST",
    "HINT",
    "LATEST",
    "MAX_VALUE_BYTES",
    "MAX_WALK",
    "latest_from_chain",
    "link",
    "link_key",
    "set_hint",
]
