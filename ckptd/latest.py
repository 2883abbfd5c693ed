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
- ``latest_step(store)`` walks from the hint (else ``first``) to the end E of the chain. If E is
  committed it is the newest committed step: every committed step is <= some element <= E. If
  E is not committed (its commit is in flight, or its save died after linking), or there is no
  chain (an empty root, or one written before the chain existed), or the walk is longer than
  ``MAX_WALK`` or malformed, it answers by listing the root, as before.
- ``set_hint`` after a successful commit moves the hint forward, so a walk is 1 GET of the hint,
  1 GET of the missing link after it, and 1 HEAD of that step's commit record.
- Links are never deleted: retention removes checkpoints, never numbers of the chain (a few
  bytes per save). A deleted chain end reads as "not committed" and falls back to listing.

A root written by an older ckptd has no chain; the first commit by this version seeds
``first`` with the larger of its own step and the newest step found by listing. Every writer of
one root must then use this version (an older writer's commits are not linked and a reader
would miss them until a newer step is linked).
"""

from __future__ import annotations

import json

from ckptd.manifest import COMMIT, step_dir
from storage_backends import NotFoundError, Store

LATEST = "_latest"
FIRST = f"{LATEST}/first.json"
HINT = f"{LATEST}/hint.json"
MAX_WALK = 64


def link_key(step: int) -> str:
    return f"{LATEST}/after_{step:010d}.json"


def _read_step(store: Store, key: str) -> int | None:
    """The step stored at ``key``; None if absent. A malformed value raises ValueError."""
    try:
        data = store.get(key)
    except NotFoundError:
        return None
    value = json.loads(data)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{key}: not a step: {data[:40]!r}")
    return value


def _dumps(step: int) -> bytes:
    return str(step).encode()


def _start(store: Store) -> int | None:
    start = _read_step(store, HINT)
    return start if start is not None else _read_step(store, FIRST)


def link(store: Store, step: int, newest_by_listing) -> bool:
    """Make the chain reach ``step`` before its commit record is written. True if ``step`` is
    an element of the chain afterwards (then the hint may point at it once it is committed).

    ``newest_by_listing(store)`` is the newest committed step found by listing, used once per
    root to seed the chain of a root that has none."""
    try:
        cur = _start(store)
    except ValueError:
        cur = None
    if cur is None:
        base = newest_by_listing(store)
        first = step if base is None or step > base else base
        if store.put_if_absent(FIRST, _dumps(first)):
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
            if store.put_if_absent(link_key(cur), _dumps(step)):
                return True
            nxt = _read_step(store, link_key(cur))
        if nxt is None or nxt <= cur:
            raise ValueError(f"{store.uri}: {link_key(cur)} is malformed (next {nxt}, after {cur})")
        cur = nxt
    raise ValueError(f"{store.uri}: the chain of {LATEST} is longer than {10 * MAX_WALK} links from its start")


def set_hint(store: Store, step: int) -> None:
    """After ``step`` committed and ``link`` said it is on the chain."""
    store.put(HINT, _dumps(step))


def latest_from_chain(store: Store) -> tuple[bool, int | None]:
    """(True, newest committed step) when the chain answers; (False, None) when the caller must
    list (no chain, a malformed or too long walk, or an end that is not committed)."""
    try:
        cur = _start(store)
        if cur is None:
            return False, None
        for _ in range(MAX_WALK):
            nxt = _read_step(store, link_key(cur))
            if nxt is None:
                break
            if nxt <= cur:
                return False, None
            cur = nxt
        else:
            return False, None
    except ValueError:
        return False, None
    if store.exists(f"{step_dir(cur)}/{COMMIT}"):
        return True, cur
    return False, None


__all__ = ["FIRST", "HINT", "LATEST", "MAX_WALK", "latest_from_chain", "link", "link_key", "set_hint"]
