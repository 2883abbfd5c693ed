"""Leases: whether the writer that claimed a step is still alive, read from storage.

Invariant: another writer takes a claimed step over only once the claim's *lease* ran out --
the newest of the claim record and its attempt's heartbeats is older than
``CKPTD_CLAIM_LEASE_S`` (default 60 s; :func:`lease_s`) -- never while the attempt renews it.
The decision itself (whose claim, which rule) is ``ckptd.claims.liveness``; this module holds
the clock: the settings, the heartbeat, and the ages read from storage.

Why a lease, not silence (a live writer can be silent for minutes, and taking its step over
then mixed two jobs' data), the heartbeat, giving a claim up (:func:`abandon`) and the fallback
for claims without a lease (:func:`idle_seconds` against :func:`stale_after`):
``docs/reliability.md``, "Fencing", point 1. A failed renewal is logged, never raised: the lease
then runs out, which only lets another writer fence this one off.

Every time read from storage goes through :func:`clamp` before it is compared with now, so a
forged or skewed record can hold a step for one lease at most.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from ckptd import catalog
from ckptd import manifest as mf
from ckptd.errors import CheckpointError
from ckptd.manifest import CLAIMS
from storage_backends import StorageError, Store

log = logging.getLogger("ckptd.leases")

DEFAULT_STALE_S = 900.0
DEFAULT_LEASE_S = 60.0


def _seconds(name: str, default: float) -> tuple[float, str]:
    """(the number of seconds in variable ``name``, else ``default``; its raw text)."""
    raw = os.environ.get(name, "").strip()
    try:
        return (float(raw) if raw else default), raw
    except ValueError:
        raise CheckpointError(f"{name}={raw!r}: expected a number of seconds") from None


def stale_after() -> float:
    """Seconds without a write after which another writer's partial step may be taken over
    (``CKPTD_STALE_ATTEMPT_S``, default 900)."""
    return _seconds("CKPTD_STALE_ATTEMPT_S", DEFAULT_STALE_S)[0]


def lease_s() -> float:
    """Seconds after its attempt's last heartbeat (or its claim) before another writer may take
    a step over: ``CKPTD_CLAIM_LEASE_S`` (default 60), or ``CKPTD_STALE_ATTEMPT_S`` if that is
    shorter (it stays the bound it always was); the heartbeat renews it every quarter."""
    value, raw = _seconds("CKPTD_CLAIM_LEASE_S", DEFAULT_LEASE_S)
    if not value > 0:
        raise CheckpointError(f"CKPTD_CLAIM_LEASE_S={raw!r}: expected a positive number of seconds")
    return min(value, stale_after())


MAX_SKEW_S = 60.0  # how far ahead of this host's clock a storage time may be and still count


def clamp(t: float, now: float) -> float:
    """A time read from storage, clamped to ``now``: a claim or heartbeat dated up to
    ``MAX_SKEW_S`` in the future (a storage clock ahead of ours) counts as written now; one
    dated further ahead (a forged file time) is no evidence of anything and counts as never
    written (0), not as alive for years -- read at every check, "now" would never expire."""
    if t != t or t > now + MAX_SKEW_S:  # NaN, or absurdly far ahead
        return 0.0
    return min(t, now)


def idle_seconds(store: Store, step: int) -> float:
    """Seconds since the newest write to the step folder, not counting claim outcomes
    (``_claims/<attempt>/...``): a refused writer's outcome records must not keep a dead job's
    step looking alive, or a job retrying the step would never reach the stale takeover."""
    prefix = f"{mf.step_dir(step)}/"
    outcomes = f"{prefix}{CLAIMS}/"
    newest = max(
        (o.mtime for o in store.list(prefix) if not (o.key.startswith(outcomes) and "/" in o.key[len(outcomes) :])),
        default=0.0,
    )
    now = time.time()
    return now - clamp(newest, now)


def alive_prefix(step: int, attempt: str) -> str:
    """Where the ranks of ``attempt`` renew their lease on ``step`` (beside the outcomes)."""
    return f"{mf.step_dir(step)}/{CLAIMS}/{attempt}/alive/"


def abandoned_key(step: int, attempt: str) -> str:
    """The record by which ``attempt``'s writer gives up its claim on ``step`` (:func:`abandon`)."""
    return f"{mf.step_dir(step)}/{CLAIMS}/{attempt}/abandoned.json"


def lease_age(store: Store, step: int, claim: str, attempt: str) -> float:
    """Seconds since the claim record ``claim`` (a key) of ``step`` or a heartbeat of
    ``attempt`` (the claim's) was last written, every time clamped to now; infinite once the
    attempt was given up (:func:`abandon`)."""
    now = time.time()
    times = [o.mtime for o in store.list(claim)]
    mine = list(store.list(f"{mf.step_dir(step)}/{CLAIMS}/{attempt}/"))
    if any(o.key == abandoned_key(step, attempt) for o in mine):
        return float("inf")
    times += [o.mtime for o in mine]
    return now - max((clamp(t, now) for t in times), default=0.0)


def abandon(store: Store, step: int, attempt: str) -> None:
    """Give up ``attempt``'s claim on ``step`` (its save failed or was abandoned): its lease
    counts as run out, so another writer takes the step over at once, fencing off whatever the
    attempt's threads still do as after a lease. Best effort: a failure is logged."""
    try:
        store.put(abandoned_key(step, attempt), mf.dumps({"time": time.time()}))
    except (StorageError, OSError) as e:
        log.warning("cannot give up the claim on %s: %s", abandoned_key(step, attempt), e)
        return
    log.warning(
        "%s: attempt %s gave its claim up (its save failed or was abandoned); another job may take the step at once",
        catalog.where(store, step),
        attempt,
    )


class Heartbeat:
    """Renews ``attempt``'s lease on ``step`` while a rank writes it (see the module docstring).
    Stop it (or leave the ``with`` block) when the rank's part is done; it also stops once
    ``abort`` is set (the save was abandoned, though its thread may stay inside a storage call)."""

    def __init__(
        self,
        store: Store,
        step: int,
        attempt: str,
        rank: int,
        period: float | None = None,
        abort: threading.Event | None = None,
    ):
        self._store = store
        self._key = f"{alive_prefix(step, attempt)}{rank:06d}.json"
        self._period = period if period is not None else max(0.05, lease_s() / 4)
        self._stop = threading.Event()
        self._abort = abort or self._stop
        self._thread = threading.Thread(target=self._run, name=f"ckptd-heartbeat-{step}", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._period) and not self._abort.is_set():
            try:
                self._store.put(self._key, mf.dumps({"time": time.time()}))
            except (StorageError, OSError) as e:
                log.warning("cannot renew the lease %s: %s", self._key, e)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


__all__ = [
    "DEFAULT_LEASE_S",
    "DEFAULT_STALE_S",
    "Heartbeat",
    "MAX_SKEW_S",
    "abandon",
    "abandoned_key",
    "alive_prefix",
    "clamp",
    "idle_seconds",
    "lease_age",
    "lease_s",
    "stale_after",
]
