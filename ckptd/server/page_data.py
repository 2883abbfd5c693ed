"""What the daemon's status page shows, and where it reads it from (``ckptd.server.page``
renders and serves it).

:func:`collect` gathers it, as plain JSON (``GET /v1/overview`` returns it; nothing is escaped
here): the job roots (each served root and those found at and below it, ``jobroots``, then the
roots of recent jobs; ``MAX_ROOTS`` shown), per root its steps, their state (partial, committed,
verified, corrupt, unreadable) and newest good step; the jobs in flight, recent failures and
superseded attempts, the last saves, stalled steps with the ranks missing, the staging budget and
this daemon's memory tier.

A job root is someone else's to write: its records are parsed strictly (:func:`read_info`: a
``time`` or ``bytes`` that is not a number makes the step "unreadable") and each root is built on
its own, so one broken root shows an error row and never blanks the page. Verdicts have one
source: the record ``ckptd verify --record`` (and :meth:`Overview.verify`) writes, ``ckptd.verify``.

Cost of a refresh: per job root one listing (``catalog.steps``), plus the commit record of steps
not seen before. Committed checkpoints are immutable, so their rows are cached for the daemon's
life; partial ones are re-read at most every ``PARTIAL_TTL_S``, and only when on the page shown
(``limit`` rows per root, newest first, paged with ``offset``); verdicts after ``VERDICT_TTL_S``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from types import SimpleNamespace

from ckptd import catalog, donetree
from ckptd import manifest as mf
from ckptd import verify as _verify
from ckptd.catalog import CheckpointInfo
from ckptd.commit import held_whole, newest_held
from ckptd.errors import CheckpointError
from ckptd.server import jobroots
from ckptd.server.jobroots import JobRoots
from ckptd.server.roots import RootError, normalize
from ckptd.server.tiers import origin_of
from storage_backends import NotFoundError, StorageError, Store

__all__ = [
    "ACTIVE",
    "CHART_SAVES",
    "FAILURES",
    "MAX_ROOTS",
    "PARTIAL_TTL_S",
    "VERDICT_TTL_S",
    "Overview",
    "collect",
    "one_line",
    "overview",
    "read_info",
    "superseded_by_another",
]

log = logging.getLogger("ckptd.server")

PARTIAL_TTL_S = 5.0
VERDICT_TTL_S = 5.0  # a recorded verdict is read again after this (a CLI verify, a quarantine)
MAX_ROOTS = 32  # job roots shown (served roots first, then the roots of recent jobs)
CHART_SAVES = 30
FAILURES = 10
ACTIVE = ("queued", "uploading", "uploaded")


class Overview:
    """What the page shows, built from the daemon's runner (jobs, staging, roots) and a cache of
    checkpoint rows. One per daemon; safe to call from the server's threads."""

    def __init__(self, runner, found: JobRoots | None = None):
        self.runner = runner
        self.found = found or JobRoots(runner)
        self._lock = threading.Lock()
        self._rows: dict[str, dict[int, tuple[CheckpointInfo, float]]] = {}
        # (root, step) -> (monotonic time read, the recorded verdict or None): ``_verdict``
        self._verified: dict[tuple[str, int], tuple[float, dict | None]] = {}
        self._reported: dict[tuple[str, int, str], tuple[float, set[int]]] = {}
        self.more_roots = 0  # job roots found but not shown (past MAX_ROOTS)

    def job_roots(self) -> list[str]:
        """The job roots found in storage at and below each served root (``jobroots``; the
        served root itself when none is found), then those of recent jobs; MAX_ROOTS shown."""
        roots: list[str] = []
        for base in self.runner.roots.uris:
            try:
                roots += self.found.get(base).roots or [base]
            except CheckpointError:
                roots.append(base)  # storage did not answer: the row of the served root says why
        roots = list(dict.fromkeys(roots + [job.root for job in reversed(self.runner.recent(self.runner.HISTORY))]))
        self.more_roots = max(0, len(roots) - MAX_ROOTS)
        return roots[:MAX_ROOTS]

    def checkpoints(self, root: str, offset: int, limit: int) -> dict:
        store = self.runner.store(root)
        steps = catalog.steps(store)  # the one listing per refresh
        now = time.monotonic()
        with self._lock:
            cache = self._rows.setdefault(root, {})
            for gone in cache.keys() - set(steps):  # deleted (gc, retention)
                del cache[gone]
        newest_first = steps[::-1]
        window = newest_first[offset : offset + limit]
        rows = [self._row(store, root, s, now) for s in window]
        newest_good = next((s for s in newest_first if self._good(store, root, s, now)), None)
        committed = next((s for s in newest_first if self._good(store, root, s, now, verdict=False)), None)
        return {
            "root": root,
            "count": len(steps),
            "offset": offset,
            "limit": limit,
            "newest_good_step": newest_good,
            "newest_committed_step": committed,
            "checkpoints": rows,
        }

    def _good(self, store: Store, root: str, step: int, now: float, verdict: bool = True) -> bool:
        """Committed, readable and (``verdict``) not recorded as failing its verify."""
        try:
            info = self._info(store, root, step, now)
        except (CheckpointError, StorageError):
            return False
        return info.committed and (not verdict or self._verdict(store, root, step, now).get("ok", True))

    def _info(self, store: Store, root: str, step: int, now: float) -> CheckpointInfo:
        with self._lock:
            hit = self._rows.get(root, {}).get(step)
        if hit is not None and (hit[0].committed or now - hit[1] < PARTIAL_TTL_S):
            return hit[0]
        info = read_info(store, step)
        with self._lock:
            self._rows.setdefault(root, {})[step] = (info, now)
        return info

    def _row(self, store: Store, root: str, step: int, now: float) -> dict:
        try:
            info = self._info(store, root, step, now)
        except (CheckpointError, StorageError) as e:
            unknown = dict.fromkeys(("world_size", "bytes", "time"))
            return {"step": step, "committed": False, **unknown, "state": "unreadable", "error": str(e)}
        if not info.committed:
            return info.to_json() | {"state": "partial"}
        verdict = self._verdict(store, root, step, now)
        if not verdict:
            return info.to_json() | {"state": "committed"}
        return info.to_json() | {"state": "verified" if verdict["ok"] else "corrupt", "verify": verdict}

    def _verdict(self, store: Store, root: str, step: int, now: float) -> dict:
        """The verdict ``ckptd verify`` recorded for the step's current commit (``_verify.json``,
        bound to the commit record and manifest it judged: what ``ls``, ``gc`` and
        ``restore(fallback=True)`` read), {} when none; re-read after VERDICT_TTL_S, so a
        quarantine, a re-save or a CLI ``verify`` shows at the next refreshes."""
        with self._lock:
            hit = self._verified.get((root, step))
        if hit is None or now - hit[0] > VERDICT_TTL_S:
            hit = (now, _verify.read_record(store, step))
            with self._lock:
                for k in [k for k, v in self._verified.items() if now - v[0] > VERDICT_TTL_S]:
                    del self._verified[k]
                self._verified[(root, step)] = hit
        rec = hit[1]
        return {} if rec is None else {k: rec[k] for k in ("ok", "time", "bytes")} | {"errors": rec["errors"][:3]}

    def verify(self, root: str, step: int) -> dict:
        """``ckptd verify --record`` of a committed step (the one source of verdicts);
        ``recorded`` is False, with the reason, when the root cannot take the record."""
        store = self.runner.store(root)
        report = _verify.verify(store, step, threads=4)
        verdict = {"ok": report.ok, "time": time.time(), "bytes": report.bytes, "errors": report.errors[:3]}
        try:
            _verify.write_record(store, report)
            recorded, why = True, None
        except CheckpointError as e:
            recorded, why = False, str(e)
        with self._lock:
            self._verified.pop((root, report.step), None)
        return {"root": root, "step": report.step, **verdict, "recorded": recorded, "not_recorded": why}

    def jobs(self) -> dict:
        now = time.time()
        recent = [j.status() for j in self.runner.recent(self.runner.HISTORY)]
        active = []
        for j in recent:
            if j["state"] not in ACTIVE:
                continue
            total = j["bytes_total"]
            done = total if j["state"] == "uploaded" else min(j["bytes_uploaded"], total)
            rate = eta = None
            started = j.get("upload_started_at")
            if j["state"] == "uploading" and started and now > started:
                rate = done / (now - started)
                eta = (total - done) / rate if rate > 0 else None
            # waiting: since this rank's data was uploaded (its done record written)
            waiting = now - (j.get("uploaded_at") or j["accepted_at"]) if j["state"] == "uploaded" else None
            progress = {"bytes_done": done, "rate": rate, "eta_s": eta, "age_s": now - j["accepted_at"]}
            active.append(j | progress | {"waiting_s": waiting})
        ended = [j for j in reversed(recent) if j["state"] in ("failed", "discarded")]
        # A newer attempt of the step (a restarted job's) made this one moot: no failure of the save.
        superseded = [j for j in ended if superseded_by_another(j.get("error"))][:FAILURES]
        failures = [j for j in ended if not superseded_by_another(j.get("error"))][:FAILURES]
        saves: dict[tuple, dict] = {}
        for j in recent:
            if j["state"] != "committed" or j.get("committed_at") is None:
                continue
            s = saves.setdefault(
                (j["root"], j["step"], j["attempt"]),
                {"root": j["root"], "step": j["step"], "blocked_s": 0.0, "first": j["accepted_at"], "last": 0.0},
            )
            s["blocked_s"] = max(s["blocked_s"], j.get("staged_s") or 0.0)
            s["first"] = min(s["first"], j["accepted_at"])
            s["last"] = max(s["last"], j["committed_at"])
            s["bytes"] = s.get("bytes", 0) + j["bytes_written"]
        chart = sorted(saves.values(), key=lambda s: s["last"])[-CHART_SAVES:]
        for s in chart:
            s["commit_s"] = s.pop("last") - s.pop("first")
        stalled = self._stalled(active)
        return {"active": active, "failures": failures, "superseded": superseded, "saves": chart, "stalled": stalled}

    def _stalled(self, active: list[dict]) -> list[dict]:
        """Steps whose ranks here waited longer than ``stall_after_s`` for the others, with the
        ranks that wrote no done record (one listing per step, at most every PARTIAL_TTL_S)."""
        limit = self.runner.settings.stall_after_s
        steps: dict[tuple[str, int, str], dict] = {}
        for j in active:
            if j["waiting_s"] is None or j["waiting_s"] < limit:
                continue
            k = (j["root"], j["step"], j["attempt"])
            s = steps.setdefault(k, {f: j[f] for f in ("root", "step", "attempt", "world_size")})
            s["waiting_s"] = max(s.get("waiting_s", 0.0), j["waiting_s"])
        now = time.monotonic()
        for k, s in steps.items():
            with self._lock:
                hit = self._reported.get(k)
            if hit is None or now - hit[0] >= PARTIAL_TTL_S:
                try:
                    hit = (now, donetree.reported_ranks(self.runner.store(k[0]), k[1], k[2]))
                except (StorageError, CheckpointError, ValueError) as e:
                    s["error"] = str(e)
                    continue
                with self._lock:
                    self._reported[k] = hit
            s["missing_ranks"] = sorted(set(range(s["world_size"])) - hit[1])
        return sorted(steps.values(), key=lambda s: (s["root"], s["step"]))

    def build(self, focus_root: str | None, offset: int, limit: int) -> dict:
        staging = self.runner.staging
        roots = []
        for r in self.job_roots():
            off = offset if r == focus_root else 0
            try:
                roots.append(self.checkpoints(r, off, limit))
            except (CheckpointError, StorageError, RootError) as e:
                roots.append({"root": r, "error": str(e)})
            except Exception as e:  # noqa: BLE001 - one root's data never blanks the page for all
                log.warning("status page: job root %s: %r", r, e)
                roots.append({"root": r, "error": f"cannot show this root: {type(e).__name__}: {e}"})
        now = time.time()
        st = {"budget": staging.budget, "staged_bytes": staging.staged_bytes, "leases": staging.lease_count}
        st |= {"queue_depth": self.runner.queue_depth, "awaiting_commit": self.runner.watching}
        return {"time": now, "roots": roots, "staging": st, **self.jobs(), "more_roots": self.more_roots}


# What a job's error says when another attempt of its step took over (the job restarted, a
# rank saved the step again): ``claims.begin``'s StepClaimed and AlreadyCommitted, the commit
# check (``commit._claimed_manifest``), the commit watch, and the restart check (``jobs.Runner._superseded``).
_SUPERSEDED = (
    "was committed by another attempt",
    "was superseded by attempt",
    "a newer attempt of the same step has started",
    "is already committed; refusing to overwrite",
    "the step is claimed by job",  # commit._claimed_manifest: another attempt owns the step now
)


def superseded_by_another(error: str | None) -> bool:
    return bool(error) and any(p in error for p in _SUPERSEDED)


def read_info(store: Store, step: int) -> CheckpointInfo:
    """One row of ``ckptd ls``: the commit record, or for a partial step its folder's objects."""
    folder = mf.step_dir(step)
    commit = catalog.read_commit(store, step)
    if commit is not None:
        where = f"{store.uri.rstrip('/')}/{folder}/{mf.COMMIT}"
        ws, size = _field(commit, "world_size", where, least=1), _field(commit, "bytes", where)
        return CheckpointInfo(step, True, ws, size, _field(commit, "time", where, real=True), folder)
    ws = None
    with contextlib.suppress(NotFoundError, ValueError, AttributeError, CheckpointError):
        where = catalog.where(store, step)
        ws = mf.read_json(store, f"{folder}/{mf.MANIFEST}", where, "manifest", mf.MAX_MANIFEST_BYTES).get("world_size")
    objs = list(store.list(f"{folder}/"))
    mtime = max((o.mtime for o in objs), default=None)
    return CheckpointInfo(step, False, ws, sum(o.size for o in objs), mtime, folder)


def _field(record: dict, name: str, where: str, least: int = 0, real: bool = False) -> float | int | None:
    """``record[name]``: absent is None; else an int (a finite float too when ``real``) of at
    least ``least``, or CheckpointError. ``True`` is no number here."""
    value = record.get(name)
    if value is None:
        return None
    ok = isinstance(value, int) and not isinstance(value, bool)
    if real and isinstance(value, float):
        ok = math.isfinite(value)
    if not ok or value < least:
        raise CheckpointError(f"{where}: {name!r} is {one_line(repr(value), 60)}, not a number >= {least}")
    return value


def one_line(text: str | None, n: int = 240) -> str:
    """One line of at most ``n`` characters; a longer one loses its middle, not its end, which
    is where ckptd's errors say what to do."""
    one = " ".join(str(text or "").split())
    if len(one) <= n:
        return one
    tail = n // 2
    return one[: n - tail - 1] + "\u2026" + one[-tail:]


def overview(state) -> Overview:
    """The daemon's one Overview (on ``app.state``), made at the first request that needs it."""
    return jobroots.one_per_daemon(state, "overview", lambda: Overview(state.daemon.runner, jobroots.shared(state)))


def visible_tiers(tenancy, caller, d: dict) -> dict:
    """``Tiers.describe``'s answer ``d`` with the copies of the roots ``caller`` may read only
    (``Tenancy.visible``); the last push failure, which names a root, to operators only."""
    d |= {k: tenancy.visible(caller, d[k]) for k in ("hot", "replicas", "memory_only", "parity") if k in d}
    if caller.operator:
        return d
    mine = origin_of(caller.uid)  # a tenant sees its own share of the tier, not its neighbours'
    return d | {"last_push_failure": None, "origins": {k: v for k, v in d.get("origins", {}).items() if k == mine}}


def collect(state, root: str | None, offset: int, limit: int, caller=None) -> dict:
    """Everything the page shows: ``Overview.build``, paged at ``root`` (a served root, or
    RootError), and this daemon's memory tier when it has one (``state.tiers``); with
    ``caller``, of the roots it may read only (``Tenancy.visible``)."""
    data = _collect(state, root, offset, limit)
    if caller is not None:
        tenancy = state.daemon.tenancy
        for k in {"roots", "active", "failures", "superseded", "saves", "stalled", "memory_only"} & data.keys():
            data[k] = tenancy.visible(caller, data[k])
        if "tiers" in data:
            data["tiers"] = visible_tiers(tenancy, caller, data["tiers"])
    return data


def _collect(state, root: str | None, offset: int, limit: int) -> dict:
    ov = overview(state)
    if root is not None:
        ov.runner.roots.check(root)
    data = ov.build(root, offset, limit)
    tiers = getattr(state, "tiers", None)
    held: dict = {}  # (root, step, attempt) -> key -> (size, []) held here: ``commit.held_whole``'s holders
    for d in tiers.describe(keys=True)["memory_only"] if tiers is not None and tiers.enabled else []:
        held.setdefault((d["root"], d["step"], d["attempt"]), {}).update({k: (n, []) for k, n in d["keys"].items()})
    if tiers is not None:  # this daemon's memory tier: which steps it holds, for whom, where pushed
        data["tiers"] = tiers.describe()
        if tiers.enabled:
            data["memory_only"] = memory_only(tiers, held)
    for r in (r for r in data["roots"] if "error" not in r):  # the step a restore takes now, and why
        r["restore"] = restore_step(tiers, held, r["root"], r["newest_committed_step"])
    return data


def restore_step(tiers, held: dict, root: str, committed: int | None) -> dict:
    """The step a restore of ``root`` takes now, and why: ``commit.newest_held`` over ``held``, else ``committed``."""
    mine = {(s, a): (r, keys) for (r, s, a), keys in held.items() if normalize(r) == normalize(root)}
    pick = lambda s, a: _held(tiers, mine[(s, a)][0], s, a)  # noqa: E731
    got, skipped = newest_held({k: v[1] for k, v in mine.items()}, committed, pick)
    why = ["the newest committed step", *(f"memory-only step {s} is not held whole here: {w}" for s, _, w in skipped)]
    if got is not None:
        why = [f"a memory-only step held whole in this daemon's memory, newer than the newest committed ({committed})"]
    return {"step": committed if got is None else got[0], "memory_only": got is not None, "why": "; ".join(why[:2])}


def _held(tiers, root: str, step: int, attempt: str):
    """What this daemon holds of memory-only (root, step, attempt), as a store for ``commit.held_whole``."""

    def get(key: str, limit: int) -> bytes:
        if (buf := tiers.find(root, step, attempt, key)) is None or len(buf) > limit:
            raise StorageError(f"{key} is not held here, or is over {limit} bytes")
        return bytes(buf)

    return SimpleNamespace(get=get, uri=f"this daemon's memory [{root}]", close=lambda: None)


MAX_MEMSTEP_ROWS = 200  # memory-only steps listed on the page at most (newest first)


def memory_only(tiers, held: dict) -> list[dict]:
    """The memory-only steps this daemon holds (``server.tiers``), one entry per (root, step,
    attempt), newest first: its parts (this node's own ranks, and replicas with the peer they came
    from), their bytes, and whether this daemon alone holds the whole step by the restore's rule
    (``commit.held_whole``: then its ``world_size``; else ``not_whole`` says why)."""
    steps: dict[tuple[str, int, str], dict] = {}
    for d in tiers.describe(keys=True)["memory_only"]:
        s = steps.setdefault((d["root"], d["step"], d["attempt"]), {k: d[k] for k in ("root", "step", "attempt")})
        s.setdefault("parts", []).append({k: d[k] for k in ("rank", "source", "bytes", "objects", "replicated_to")})
    out = sorted(steps.values(), key=lambda s: (s["step"], s["root"]), reverse=True)[:MAX_MEMSTEP_ROWS]
    for s in out:
        s["parts"].sort(key=lambda p: (p["rank"], p["source"] != "self", p["source"]))
        s["ranks"] = sorted({p["rank"] for p in s["parts"]})
        s["bytes"] = sum(p["bytes"] for p in s["parts"])
        key = (s["root"], s["step"], s["attempt"])
        try:
            commit = held_whole(_held(tiers, *key), s["step"], s["attempt"], held.get(key, {}))
            s |= {"whole_here": True, "world_size": commit["world_size"]}
        except CheckpointError as e:
            s |= {"whole_here": False, "world_size": None, "not_whole": str(e)}
    return out
