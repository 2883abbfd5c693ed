"""The daemon's shared claim: one ``begin`` per attempt for all the ranks one daemon serves,
and one read of a step's commit record for all its jobs at once.

Invariant: a part is written only after a definitive go of ``ckptd.claims.begin`` for its
(root, step, attempt, writer) that is still :func:`ckptd.claims.trusted`; a refusal is the same
``AlreadyCommitted`` / ``StepClaimed`` for every part of the attempt; a transient failure is kept
for nobody.

The daemon cannot wait for rank 0 as ``ckptd.claims.follow_claim`` does (its upload workers are
bounded, and parts waiting for a rank 0 queued behind them would hold them all), so it claims
once per attempt for the ranks it serves (a node's, typically 8)::

    1. SharedClaim.committed(...)  the first job of a step reads commit.json; the jobs that come
                                   while it runs (or within fresh_s) share its answer
    2. SharedClaim.claim(...)      the first job of (root, step, attempt, writer) runs begin; the
                                   others wait for that running begin (never for a queued job)
                                   and share its outcome
    3. persist(claim="caller")     each job writes its part (ckptd.persist)
    4. SharedClaim.saw_commit(...) once the daemon saw the commit record (it is final)

``committed``/``saw_commit`` are a commit-record cache beside the claim: both bound a node's 2N
reads of one prefix to one. Only "not committed" is shared as is; a cached "committed" is read
again before it refuses anyone, so the cache never outlives a quarantine or a gc of the step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ckptd import catalog
from ckptd.claims import begin, trusted
from ckptd.errors import AlreadyCommitted, StepClaimed
from storage_backends import Store


class SharedClaim:
    """One claim per attempt among the parts one process persists, for
    ``persist(claim="caller")`` (the protocol above).

    Only definitive outcomes (go, ``AlreadyCommitted``, ``StepClaimed``: re-raised to every part
    with the same message) are kept; after a transient failure (the store failed or throttled,
    "cannot claim/read") a waiting part, or the next one, runs ``begin`` again. A go is trusted
    for a quarter of ``CKPTD_STALE_ATTEMPT_S`` (:func:`trusted`, as ``follow_claim`` trusts rank
    0's go). A go for another attempt of the step voids the outcomes kept for the others (a job
    restarted after preemption supersedes its dead attempt, whose parts still queued must not
    write on the old go). At most ``limit`` outcomes are kept (the oldest decided go dropped
    first). ``on_begin`` is called before every ``begin`` (``ckptd_step_claims_total``).
    ``event`` makes the object a waiter blocks on: ``threading.Event``, or a simulated one
    (``benchmarks.scale``). The lock is held only for the table, never across a request."""

    def __init__(
        self, on_begin: Callable[[], None] | None = None, event: Callable[[], Any] = threading.Event, limit: int = 1024
    ):
        self._on_begin = on_begin
        self._event = event
        self._limit = limit
        self._lock = threading.Lock()
        # (root, step, attempt, writer) -> [event, None while running | (wall time decided, error or None)]
        self._claims: dict[tuple, list] = {}
        self._reads: dict[tuple, list] = {}  # (root, step) -> [event, None while running | (monotonic, record)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._claims)

    def claim(self, store: Store, root: str, step: int, attempt: str, writer: str) -> None:
        """Claim ``step`` of ``root`` (``store``) for (``writer``, ``attempt``), once for every
        part of the attempt this object serves; raises what :func:`begin` raised."""
        key = (root, step, attempt, writer)
        while True:
            with self._lock:
                self._prune()
                entry = self._claims.get(key)  # kept only while trusted (_prune)
                mine = entry is None
                if mine:
                    entry = self._claims[key] = [self._event(), None]
                    self._prune()  # the table's bound, counting this claim
            if mine:
                return self._begin(store, key, entry)
            entry[0].wait()
            outcome = entry[1]
            if outcome is None:  # its begin failed transiently: claim again (one waiter runs begin)
                continue
            if outcome[1] is not None:  # the same refusal, a fresh exception for this part's thread
                raise type(outcome[1])(str(outcome[1]))
            return None

    def committed(self, store: Store, root: str, step: int, fresh_s: float = 1.0) -> dict | None:
        """``catalog.read_commit`` of ``step`` shared the same way: one read in flight per (root,
        step), its answer given to the callers that come while it runs or within ``fresh_s``
        seconds after; a failed read is raised to its caller and kept for nobody. An answer up
        to ``fresh_s`` old is enough: the hand-off's check is a fast refusal (the claim refuses
        a committed step), and the upload's guards a shared go, itself trusted for minutes."""
        key = (root, step)
        while True:
            with self._lock:
                now = time.monotonic()
                for k in [k for k, v in self._reads.items() if v[1] is not None and now - v[1][0] > fresh_s]:
                    del self._reads[k]
                entry = self._reads.get(key)
                mine = entry is None
                if mine:
                    entry = self._reads[key] = [self._event(), None]
            if not mine:
                entry[0].wait()
                if entry[1] is None:  # that read failed: read again
                    continue
                if entry[1][1] is None:
                    return None
                # A shared "committed" is confirmed by a read of this caller's before anyone is
                # refused on it: the step may have been quarantined or deleted since (issue 28
                # item 7: a re-save right after a quarantine was refused for a minute). Refusals
                # are rare, so this costs no read on the common path.
                rec = catalog.read_commit(store, step)
                if rec is None:
                    with self._lock:
                        if self._reads.get(key) is entry:
                            del self._reads[key]
                return rec
            try:
                rec = catalog.read_commit(store, step)
                entry[1] = (time.monotonic(), rec)
                return rec
            finally:
                if entry[1] is None:
                    with self._lock:
                        if self._reads.get(key) is entry:
                            del self._reads[key]
                entry[0].set()

    def saw_commit(self, root: str, step: int, record: dict) -> None:
        """Tell the shared reads that ``step`` of ``root`` is committed (a commit record is
        final): a step this process saw committed is never answered "not committed" from an
        older read (for a minute: the table stays bounded)."""
        entry = [self._event(), (time.monotonic() + 60.0, record)]
        entry[0].set()
        with self._lock:
            self._reads[(root, step)] = entry

    def _begin(self, store: Store, key: tuple, entry: list) -> None:
        root, step, attempt, writer = key
        if self._on_begin is not None:
            self._on_begin()
        outcome = None
        try:
            begin(store, step, attempt, writer)
            outcome = (time.time(), None)
        except (AlreadyCommitted, StepClaimed) as e:
            outcome = (time.time(), e)
            raise
        finally:
            with self._lock:
                entry[1] = outcome
                if outcome is None and self._claims.get(key) is entry:
                    del self._claims[key]  # not kept: the next part claims again
                if outcome is not None and outcome[1] is None:  # this attempt owns the step now:
                    for k in [k for k, v in self._claims.items() if k[:2] == key[:2] and k != key and v[1]]:
                        del self._claims[k]  # a go of another attempt is void (it was superseded)
            entry[0].set()

    def _prune(self) -> None:
        """Drop outcomes past their trust (under the lock), then the oldest decided ones over
        ``limit``; claims still running stay (parts wait on them)."""
        decided = [(v[1][0], k) for k, v in self._claims.items() if v[1] is not None]
        for t, k in decided:
            if not trusted(t):
                del self._claims[k]
        over = len(self._claims) - self._limit
        if over > 0:
            kept = sorted((x for x in decided if x[1] in self._claims), key=lambda x: x[0])
            for _, k in kept[:over]:
                del self._claims[k]


__all__ = ["SharedClaim"]
