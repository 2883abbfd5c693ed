"""Frequent memory-only checkpoints: which saves persist, and restoring the newest step the
surviving daemons hold whole (``Checkpointer(..., daemon=URL, persist_every=K)``).

Save: a step divisible by ``persist_every`` persists to the job root as always; any other step
is memory-only (``ckptd.server.memsteps``): every rank asks its node's daemon to reserve room
for its part (``POST /v1/tiers/reserve``) and the ranks agree (one ``all_max``): if any
daemon has no room, every rank persists the step instead (one WARNING on rank 0, and
``ckptd_tier_persisted_instead_total`` on the daemon that said no), so a memory-only save
is never silently lost and never half in memory, half in the root.

Restore (``restore``/``resume`` with no step asked, a daemon and ``tiered_restore``), on every
rank, collective:

1. rank 0 reads the newest committed step P of the root (``catalog.latest_step``) and asks its
   daemon and the peers that daemon names which parts of memory-only steps of this root they
   hold (``GET /v1/tiers``); the union is grouped by (step, attempt);
2. newest first, a (step, attempt) newer than P counts only when the union holds its
   ``manifest.json`` (naming that step and attempt), every rank's done record of that attempt,
   every object those records pin (with the pinned size), and the records' shard digest equals
   the manifest's (the commit rule of ``ckptd.commit``, applied in memory);
3. rank 0 broadcasts its choice; every rank then runs the one restore path
   (``restore._restore_step``: ``layout.plan_reads`` unchanged, any world size) over a
   read-only store of those tiers (:class:`TierPartsStore`): every chunk is checked against
   its crc32c and the writers' pins, the manifest against the sha256 rank 0 computed, and no
   byte comes from the job root. Its "commit record" is the one the commit would have written
   (attempt, world size, manifest sha256, pin digest), built by rank 0 from the records.
4. if none counts, or the restore fails on any rank (a tier died midway, a bad chunk with no
   other holder), every rank falls back to the persisted path exactly as before.

Fencing: after any restore of step S, each rank tells its daemon, and rank 0 every daemon it
asked, that the root restored S (``POST /v1/tiers/restored``); they drop memory-only steps newer
than S, the future the job abandoned (docs/reliability.md argues why no restore mixes two).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
from typing import Any

from ckptd import catalog, donetree
from ckptd import manifest as mf
from ckptd.commit import expected_digest
from ckptd.errors import CheckpointError, StateMismatchError
from storage_backends import StorageError, Store
from trainer_hooks.memparts import TierPartsStore, _Daemon

__all__ = [
    "TierPartsStore",
    "choose",
    "fence",
    "memory_only_save",
    "reserve_bytes",
    "reserve_objects",
    "restore_newest",
]

log = logging.getLogger("ckptd.memsteps")


# ------------------------------------------------------------------------------------ save


def reserve_bytes(job) -> int:
    """An upper bound of the bytes rank's part of a step holds in a daemon's memory: its shard
    objects (images with their checksums; a shard without one gains 4 bytes per chunk), its
    metadata and its done record."""
    total = 0
    for s in job.shards:
        t = s.image if s.image is not None else s.buffer
        total += t.numel() * t.element_size() + 4 * max(1, s.buffer.shape[0] if s.buffer.dim() else 1) + 64
    total += sum(len(b) for _, b in job.metadata)
    return total + (1 << 20) + len(job.shards) * 256  # done record: a pin per shard, and room


def reserve_objects(job) -> int:
    """An upper bound of the objects rank's part holds: one per shard, one per metadata object,
    and its done record (and room)."""
    return len(job.shards) + len(job.metadata) + 4


def memory_only_save(sink, coord, step: int, attempt: str, job, persist_every: int) -> bool:
    """Whether ``step`` is saved memory-only: not a multiple of ``persist_every``, and every
    rank's daemon reserved room for its part. Collective (one ``all_max``)."""
    if persist_every <= 1 or step % persist_every == 0:
        return False
    try:
        ok = sink.reserve_memory(step, attempt, reserve_bytes(job), reserve_objects(job))
    except CheckpointError as e:
        log.warning("rank %d: cannot reserve room for memory-only step %d: %s", coord.rank, step, e)
        ok = False
    refused = coord.all_max([0 if ok else 1])[0]
    if refused and coord.rank == 0:
        log.warning(
            "step %d was to be memory-only but a daemon has no room for it (its staging budget, or the "
            "descriptors and mappings its memory tier may use): "
            "persisting it to the job root instead",
            step,
        )
    return not refused


# ------------------------------------------------------------------------------ choosing


def survey(daemon_url: str, root: str, token: str | None, timeout_s: float) -> tuple[dict, list[str], dict]:
    """(step, attempt) -> key -> (size, [URLs], own daemon first) over the daemon and the peers
    it names; the URLs that answered; and the data path each advertised (URL -> {"port",
    "socket"}). A daemon that does not answer is left out (logged)."""
    held: dict[tuple[int, str], dict[str, tuple[int, list[str]]]] = {}
    asked: list[str] = []
    data: dict[str, dict] = {}
    todo, seen = [daemon_url.rstrip("/")], set()
    while todo:
        url = todo.pop(0)
        if url in seen:
            continue
        seen.add(url)
        try:
            parts, peers, endpoint = _Daemon(url, token, timeout_s).parts(root)
        except (OSError, ValueError, http.client.HTTPException, CheckpointError) as e:
            log.warning("restore: the memory tier of %s did not answer: %s", url, e)
            continue
        asked.append(url)
        if endpoint is not None:
            data[url] = endpoint
        if url == daemon_url.rstrip("/"):
            todo += [p.rstrip("/") for p in peers]
        for p in parts:
            try:
                gid = (int(p["step"]), str(p["attempt"]))
                keys = {str(k): int(v) for k, v in p["keys"].items()}
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
            table = held.setdefault(gid, {})
            for k, size in keys.items():
                got = table.setdefault(k, (size, []))
                if got[0] == size and url not in got[1]:
                    got[1].append(url)
    return held, asked, data


def _complete(root: str, step: int, attempt: str, holders: dict, token, timeout_s, own, data) -> dict:
    """The commit record of memory-only (step, attempt) if the union ``holders`` holds it whole
    (module docstring, 2); CheckpointError saying what is missing otherwise."""
    store = TierPartsStore(root, step, attempt, holders, None, token, timeout_s, own, data)
    try:
        return _check_whole(store, step, attempt, holders)
    finally:
        store.close()


def _check_whole(store: TierPartsStore, step: int, attempt: str, holders: dict) -> dict:
    folder = mf.step_dir(step)
    try:
        data = store.get(f"{folder}/{mf.MANIFEST}", limit=mf.MAX_MANIFEST_BYTES)
    except StorageError as e:
        raise CheckpointError(f"no manifest held ({e})") from None
    m = mf.Manifest.from_bytes(data, store.uri)
    if m.step != step or m.attempt != attempt:
        raise CheckpointError(f"the manifest names step {m.step} attempt {m.attempt!r}")
    sha = hashlib.sha256(data).hexdigest()
    totals, pinned_manifest, written = [], False, 0.0
    for r in range(m.world_size):
        prefix = f"{donetree.folder(step, attempt, 1, r // donetree.FANOUT)}r{r:06d}."
        key = next((k for k in sorted(holders) if k.startswith(prefix)), None)
        if key is None:
            raise CheckpointError(f"the done record of rank {r} is not held")
        try:
            rec = json.loads(store.get(key, limit=mf.MAX_RECORD_BYTES))
            pins = rec["pins"]
            for k, (size, _) in pins.get("shards", {}).items():
                got = holders.get(f"{folder}/{k}")
                if got is None or got[0] != size:
                    raise CheckpointError(f"{k} (pinned by rank {r}) is not held whole")
            for k, want in pins.get("meta", {}).items():
                if f"{folder}/{k}" not in holders:
                    raise CheckpointError(f"{k} (pinned by rank {r}) is not held")
                if k == mf.MANIFEST:
                    if want != sha:
                        raise CheckpointError("the manifest differs from the one its writer pinned")
                    pinned_manifest = True
            totals.append(donetree.record_totals(rec))
            written = max(written, float(rec.get("time") or 0.0))
        except (StorageError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise CheckpointError(f"the done record of rank {r} is unreadable ({e})") from None
    if not pinned_manifest:
        raise CheckpointError("no done record pins the manifest")
    total = donetree.sum_totals(totals)
    if expected_digest(m) != total.digest:
        raise CheckpointError("the done records do not name every shard the manifest needs")
    return {
        "step": step,
        "attempt": attempt,
        "world_size": m.world_size,
        "bytes": total.bytes,
        "objects": total.objects,
        "manifest_sha256": sha,
        "time": written,  # the newest done record's: two whole attempts of a step, the later wins
        "memory_only": True,
        **({} if total.pins is None else {"pins": f"{total.pins:016x}"}),
    }


def choose(root: str, daemon_url: str, newest_persisted: int | None, token, timeout_s) -> tuple[Any, list[str]]:
    """Rank 0: (the newest memory-only step newer than ``newest_persisted`` that the surviving
    tiers hold whole, as ``(step, attempt, holders, commit, data paths)``, or None; the daemons
    asked)."""
    held, asked, data = survey(daemon_url, root, token, timeout_s)
    for step in sorted({s for s, _ in held}, reverse=True):
        if newest_persisted is not None and step <= newest_persisted:
            break
        whole = []
        for attempt in sorted(a for s, a in held if s == step):
            try:
                whole.append(
                    (attempt, _complete(root, step, attempt, held[(step, attempt)], token, timeout_s, daemon_url, data))
                )
            except CheckpointError as e:
                log.info("memory-only step %d (attempt %s) is not held whole: %s", step, attempt, e)
        if whole:  # two whole attempts of one step (the job restored and saved it again): the later
            attempt, commit = max(whole, key=lambda w: w[1]["time"])
            return (step, attempt, held[(step, attempt)], commit, data), asked
    return None, asked


def fence(urls: list[str], root: str, step: int, token, timeout_s) -> None:
    """Tell each daemon of ``urls`` that ``root`` restored ``step`` (``POST /v1/tiers/restored``):
    memory-only steps newer than it are dropped. Best effort: a daemon that is gone holds
    nothing any more."""
    body = json.dumps({"job_root": root, "restored_step": step}).encode()
    for url in dict.fromkeys(u.rstrip("/") for u in urls):
        try:
            status, _, raw = _Daemon(url, token, timeout_s).request("POST", "/v1/tiers/restored", body)
            if status != 200:
                log.warning("restore: %s did not take the fence at step %d: HTTP %d %s", url, step, status, raw[:200])
        except (OSError, http.client.HTTPException, CheckpointError) as e:
            log.warning("restore: could not tell %s that step %d was restored: %s", url, step, e)


# ----------------------------------------------------------------------------- restoring


def restore_newest(
    store: Store, coord, state, strict: bool, pool, in_place: bool, tiers
) -> tuple[int | None, list[str]]:
    """Restore the newest memory-only step the surviving tiers hold whole, if it is newer than
    the newest persisted step (module docstring). Collective. Returns (the step restored, or
    None when the persisted path must run; the daemons rank 0 asked, for the fence)."""
    from trainer_hooks.restore import _restore_step  # the one restore path

    choice: Any = None
    asked: list[str] = []
    if coord.rank == 0:
        try:
            newest = catalog.latest_step(store)
            choice, asked = choose(tiers.root_uri, tiers.daemon_url, newest, tiers._token, tiers.timeout_s)
        except (CheckpointError, StorageError) as e:
            log.warning("restore: not looking for memory-only steps: %s", e)
    choice, asked = coord.broadcast((choice, asked))
    if choice is None:
        return None, asked
    step, attempt, holders, commit, data = choice
    holders = {k: (v[0], list(v[1])) for k, v in holders.items()}
    parts = TierPartsStore(
        tiers.root_uri, step, attempt, holders, commit, tiers._token, tiers.timeout_s, tiers.daemon_url, data
    )
    parts.map_own()  # this node's daemon: its sealed memory, mapped
    try:
        got = _restore_step(
            parts,
            coord,
            state,
            step,
            strict=strict,
            pool=pool,
            restore_rng=True,
            in_place=in_place,
            planned=False,
            tiers=None,
        )
    except StateMismatchError:
        raise
    except CheckpointError as e:  # agreed on every rank: all fall back together
        log.warning("restore: memory-only step %d did not restore (%s); restoring the newest persisted step", step, e)
        return None, asked
    finally:
        parts.close()
    tiers.last = dict(parts.bytes)
    try:  # the daemon's ckptd_restore_bytes_*_total, as a tiered restore reports them
        body = json.dumps({"local": parts.bytes["local"], "peer": parts.bytes["peer"], "root": 0}).encode()
        _Daemon(tiers.daemon_url, tiers._token, tiers.timeout_s).request("POST", "/v1/tiers/restored", body)
    except (OSError, http.client.HTTPException, CheckpointError) as e:
        log.debug("restore: could not report tier bytes to the daemon: %s", e)
    log.info(
        "restored memory-only step %d: %d bytes from this node's daemon, %d from peers, 0 from the job root",
        got,
        parts.bytes["local"],
        parts.bytes["peer"],
    )
    return got, asked
