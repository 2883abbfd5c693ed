"""The commit: when one attempt's parts become a committed checkpoint, and how ranks learn it.

Invariant: ``commit.json`` is created once (``put_if_absent``, :func:`commit_step`) and only when
the step's newest claim, its ``manifest.json`` (same step, attempt and world size) and a done
record of every rank 0 .. N-1 all name the committing attempt, and the done records name every
shard the manifest needs and nothing else (:func:`whole_step`); ``ckptd verify``
re-checks the attempts and the count of done records on a committed step
(:func:`check_consistency`). A committed checkpoint is immutable.

The call sequence, on each rank once its data and done record are durable (``ckptd.persist``)::

    1. finish_rank / climb      climb the done tree (ckptd.donetree); the rank that completes
                                it runs 2-4, the others stop
    2.   _check_before_commit   the claim, then whole_step (the commit rule, a pure function of
                                the manifest and the done totals, which the memory-only
                                choice also uses); raises if any fails, nothing is committed
    3.   commit_step            link the step into the latest-step chain (ckptd.latest), then
                                put_if_absent commit.json, then move the chain's hint
    4.   _write_notices         above 1024 ranks: the notices the waiting ranks poll
    5. wait_commit              the others poll commit.json (or their group's notice), paced
                                by poll_delays, bounded by a timeout

Who owns the step is ``ckptd.claims``; one rank's write is ``ckptd.persist``; what happens after
(the sweep and retention) is ``ckptd.retention``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from collections import Counter

from ckptd import catalog, donetree, latest
from ckptd import manifest as mf
from ckptd.claims import claims, owner
from ckptd.errors import CheckpointError, StepClaimed
from storage_backends import NotFoundError, StorageError, Store

log = logging.getLogger("ckptd.commit")


def expected_shards(manifest: mf.Manifest) -> set[str]:
    """Every shard object (key relative to the step folder) the manifest's tensors need: each
    shard of the grid of every array that has data (not empty, not an inline scalar)."""
    out = set()
    for e in manifest.tensors.values():
        lay = e.layout
        if e.value is not None or lay.nbytes == 0:
            continue
        if math.prod(lay.grid_shape) > 1 << 24:
            raise CheckpointError(
                f"array {e.key!r}: {math.prod(lay.grid_shape)} shards is more than a checkpoint can have"
            )
        out.update(f"{e.path}/{lay.shard_key(c)}" for c in lay.shard_coords())
    return out


def expected_digest(manifest: mf.Manifest) -> int:
    """``donetree.shard_digest(expected_shards(manifest), step, attempt)`` of the manifest's
    step and attempt in O(arrays): each array's grid sums in closed form
    (``donetree.grid_digest``), so a commit at 4096 ranks x 900 arrays hashes 900 paths instead
    of 3.7 million shard keys."""
    total = 0
    for e in manifest.tensors.values():
        if e.value is None and e.layout.nbytes != 0:
            total += donetree.grid_digest(e.path, e.layout.grid_shape, manifest.step, manifest.attempt)
    return total % donetree.P


def _claimed_manifest(store: Store, step: int, attempt: str, where: str) -> tuple[dict, mf.Manifest, str]:
    """(the owning claim, the manifest, the manifest's sha256) of ``attempt``, which must own the
    step (newest claim); the manifest is read under its size cap. Raises otherwise."""
    rec = owner(store, step)
    if rec is None or rec.get("attempt") != attempt:
        who = "nobody" if rec is None else f"job {rec.get('writer')!r} (attempt {rec.get('attempt')!r})"
        raise StepClaimed(f"{where}: not committing attempt {attempt}: the step is claimed by {who}")
    try:
        data = store.get(f"{mf.step_dir(step)}/{mf.MANIFEST}", limit=mf.MAX_MANIFEST_BYTES)
    except NotFoundError:
        raise CheckpointError(f"{where}: not committing attempt {attempt}: manifest.json is missing") from None
    return rec, mf.Manifest.from_bytes(data, where), hashlib.sha256(data).hexdigest()


# -- the scalable commit (issue 17): the done tree, the latest-step chain, paced polling ------------


def finish_rank(
    store: Store, step: int, attempt: str, rank: int, world_size: int, record: dict, extra: dict | None = None
) -> bool:
    """Rank's part of the commit, once all its data is durable: :func:`donetree.write_done`
    then :func:`climb`. True for the one caller that created the commit record."""
    donetree.write_done(store, step, attempt, rank, record)
    return climb(store, step, attempt, rank, world_size, extra)


def climb(store: Store, step: int, attempt: str, rank: int, world_size: int, extra: dict | None = None) -> bool:
    """Steps 1-4 of the module docstring once rank's done record is durable (``extra``: more
    fields of ``commit.json``). True for the one caller that created the commit record."""

    def commit(total: donetree.Totals) -> bool:
        rec = _check_before_commit(store, step, attempt, world_size, total)
        won = commit_step(store, step, {**rec, **(extra or {})})
        if won:
            _write_notices(store, step, attempt, world_size)
        return won

    return donetree.climb(store, step, attempt, rank, world_size, commit)


def _check_before_commit(store: Store, step: int, attempt: str, world_size: int, total) -> dict:
    """Step 2 of the module docstring, by the rank that completed the done tree (one record of
    ``attempt`` per rank; other attempts' are in other folders): the claim
    (:func:`_claimed_manifest`), then :func:`whole_step`, which reads the records only if it
    must. Returns the commit record."""
    where = catalog.where(store, step)
    rec, m, sha = _claimed_manifest(store, step, attempt, where)

    def records():  # listed and read only if whole_step asks: the one the tree counted per rank
        seen: set[int] = set()
        for info in store.list(f"{mf.step_dir(step)}/{mf.DONE}/{attempt}/t1/"):
            r = donetree.record_rank(info.key, step, attempt)
            if r is not None and r < world_size and r not in seen:
                seen.add(r)
                yield info.key, mf.read_json(store, info.key, where, "done record")

    return whole_step(where, step, attempt, world_size, m, sha, rec.get("writer"), total, records(), time.time())


def whole_step(where: str, step: int, attempt: str, world_size: int, m, sha: str, writer, total, records, now) -> dict:
    """The commit rule, a pure function that the root's commit (:func:`_check_before_commit`) and
    the memory-only choice (``trainer_hooks.memsteps``) both decide with: the commit record
    (``now`` its time) if manifest ``m`` (sha256 ``sha``) and the done records of ``attempt``,
    one per rank 0 .. N-1 and summed into ``total`` (``donetree.Totals``), make ``step`` whole;
    CheckpointError naming what fails otherwise.

    1. the manifest names ``step``, ``attempt`` and ``world_size``;
    2. the done records name every shard the manifest needs and nothing else: ``total.digest``
       (keyed by step, attempt, array path and arity) equals the manifest's when each shard is
       named once (:func:`expected_digest`, O(arrays)). If not, ``records`` ((key, record)
       pairs, one per rank, read lazily) are read: the step is refused if a record does not add
       up to its key's totals for this step and attempt (copied from another attempt, or written
       by a ckptd whose digest differs) or names a key twice, or a shard is named by no record
       or is not the manifest's. Several ranks may name one shard: ranks that hold the same
       slice (a 2-D mesh's replicas) each write it, the same bytes.

    The record keeps the pin digest (what every rank wrote, object by object) and the
    manifest's sha256, which readers check."""
    if (m.step, m.attempt, m.world_size) != (step, attempt, world_size):
        raise CheckpointError(
            f"{where}: not committing attempt {attempt} of world size {world_size}: the manifest names step "
            f"{m.step}, attempt {m.attempt!r}, world size {m.world_size}"
        )
    if expected_digest(m) != total.digest:
        named: Counter[str] = Counter()
        for key, rec in records:
            try:
                if donetree.record_totals(rec, step, attempt) != donetree.key_totals(key):
                    old = rec.get("shard_digest") != donetree.DIGEST_VERSION
                    why = " (written by a ckptd with another shard digest: save the step again)" if old else ""
                    raise CheckpointError(
                        f"{where}: done record {key} does not add up to its name for this attempt{why}"
                    )
                shards = rec.get("shards", ())
                if len(set(shards)) != len(shards):
                    raise CheckpointError(f"{where}: done record {key} names a shard key more than once")
                named.update(shards)
            except (TypeError, AttributeError, ValueError) as e:
                raise CheckpointError(f"{where}: done record {key} is malformed ({e!r})") from None
        need = expected_shards(m)
        missing = sorted(need - named.keys())
        odd = sorted(named.keys() - need)
        why = (
            f"no rank wrote {len(missing)} shard objects the manifest needs, e.g. {missing[0]}"
            if missing
            else f"the done records name {len(odd)} shard keys not in the manifest, e.g. {odd[0]}"
            if odd
            else None
            if any(n > 1 for n in named.values())  # ranks holding the same slice named it each
            else "the done records' shard digest is not the manifest's"
        )
        if why is not None:
            raise CheckpointError(f"{where}: not committing attempt {attempt}: {why}")
    return {
        "step": step,
        "attempt": attempt,
        "writer": writer,
        "world_size": world_size,
        "bytes": total.bytes,
        "objects": total.objects,
        "time": now,
        "manifest_sha256": sha,
        **({} if total.pins is None else {"pins": f"{total.pins:016x}"}),
        "done_layout": "tree",
    }


def held_whole(store, step: int, attempt: str, holders: dict) -> dict:
    """:func:`whole_step`'s record of memory-only (step, attempt) as tiers hold it (``holders``: key -> (size, ...);
    ``store.get(key, limit)`` reads one), or CheckpointError naming what is not held."""
    folder = mf.step_dir(step)
    try:
        data = store.get(f"{folder}/{mf.MANIFEST}", mf.MAX_MANIFEST_BYTES)
    except StorageError as e:
        raise CheckpointError(f"no manifest held ({e})") from None
    m = mf.Manifest.from_bytes(data, store.uri)
    sha = hashlib.sha256(data).hexdigest()
    records, totals, pinned_manifest, written = {}, [], False, 0.0
    for r in range(m.world_size):
        prefix = f"{donetree.folder(step, attempt, 1, r // donetree.FANOUT)}r{r:06d}."
        key = next((k for k in sorted(holders) if k.startswith(prefix)), None)
        if key is None:
            raise CheckpointError(f"the done record of rank {r} is not held")
        try:
            rec = records[key] = json.loads(store.get(key, mf.MAX_RECORD_BYTES))
            pins = rec["pins"]
            for k, (size, *_) in pins.get("shards", {}).items():
                got = holders.get(f"{folder}/{k}")
                if got is None or got[0] != size:
                    raise CheckpointError(f"{k} (pinned by rank {r}) is not held whole")
            for k, want in pins.get("meta", {}).items():
                if f"{folder}/{k}" not in holders:
                    raise CheckpointError(f"{k} (pinned by rank {r}) is not held")
                if k == mf.MANIFEST and want != sha:
                    raise CheckpointError("the manifest differs from the one its writer pinned")
                pinned_manifest |= k == mf.MANIFEST
            totals.append(donetree.key_totals(key))  # what its name adds up to, as the tree sums it
            written = max(written, float(rec.get("time") or 0.0))
        except (StorageError, ValueError, TypeError, KeyError, AttributeError) as e:
            raise CheckpointError(f"the done record of rank {r} is unreadable ({e})") from None
    if not pinned_manifest:
        raise CheckpointError("no done record pins the manifest")
    writer = next(iter(records.values())).get("writer")
    total = donetree.sum_totals(totals)  # "time": the newest done record's (two whole attempts: the later wins)
    return whole_step(store.uri, step, attempt, m.world_size, m, sha, writer, total, records.items(), written)


def newest_held(held: dict, newer_than: int | None, source) -> tuple[tuple[int, str, dict] | None, list]:
    """The memory-only step a restore takes: of ``held`` ((step, attempt) -> holders) newer than ``newer_than``, the
    newest :func:`held_whole` finds whole in ``source(step, attempt)`` (of two attempts the later) as (step, attempt,
    commit), or None; and (step, attempt, why) of the newer ones not whole."""
    skipped = []
    for step in sorted({s for s, _ in held}, reverse=True):
        if newer_than is not None and step <= newer_than:
            break
        whole = []
        for attempt in sorted(a for s, a in held if s == step):
            store = source(step, attempt)
            try:
                whole.append((attempt, held_whole(store, step, attempt, held[(step, attempt)])))
            except CheckpointError as e:
                skipped.append((step, attempt, str(e)))
            finally:
                store.close()
        if whole:  # two whole attempts of one step (the job restored and saved it again): the later
            return (step, *max(whole, key=lambda w: w[1]["time"])), skipped
    return None, skipped


def _write_notices(store: Store, step: int, attempt: str, world_size: int) -> None:
    """After the commit: the notices waiting ranks poll above 1024 ranks. A failure only slows
    the waiters down (they also check ``commit.json``), so it never fails the committed save."""
    for key in donetree.notice_keys(step, attempt, world_size):
        try:
            store.put(key, b"{}")
        except StorageError as e:
            log.warning("%s: could not write commit notice %s: %s", store.uri, key, e)
            return


def commit_step(store: Store, step: int, record: dict) -> bool:
    """Create ``commit.json`` once (``put_if_absent``); True for the one caller that created it.

    Every commit goes through here: it links ``step`` into the chain of ``ckptd.latest`` first,
    so that ``catalog.latest_step`` can trust the chain, and moves the chain's hint after."""
    on_chain = False
    try:
        on_chain = latest.link(store, step, catalog.latest_step_by_listing)
    except ValueError as e:  # a malformed chain: readers fall back to listing where they meet it
        log.warning("%s: not linking step %d into the latest-step chain: %s", store.uri, step, e)
    won = store.put_if_absent(f"{mf.step_dir(step)}/{mf.COMMIT}", mf.dumps(record))
    if won and on_chain:
        try:
            latest.set_hint(store, step)
        except StorageError as e:  # only costs later readers a longer walk
            log.warning("%s: could not move the latest-step hint to %d: %s", store.uri, step, e)
    return won


POLLS_PER_SECOND = 2000  # all ranks of a job together, on the one commit.json (S3: 5500/prefix)
PACED_ABOVE = 64  # up to this many ranks polls double from 5 ms; above, POLLS_PER_SECOND paces them


def poll_delays(world_size: int, rank: int):
    """The pauses of one rank polling for ``commit.json``: up to ``PACED_ABOVE`` ranks, 5 ms doubling to
    50 ms; above, every pause is drawn from [0.5, 1.5) x ``world_size / POLLS_PER_SECOND`` (at
    most 8 s), so that ranks finishing together do not poll in step and the sum over all ranks
    stays near ``POLLS_PER_SECOND`` from the first poll on (a doubling start lets thousands of
    ranks poll at 200/s each at first: 1024 ranks met SlowDowns that way in the simulator)."""
    if world_size <= PACED_ABOVE:
        delay = 0.005
        while True:
            yield delay
            delay = min(delay * 2, 0.05)
    mean = min(8.0, world_size / POLLS_PER_SECOND)
    rng = random.Random(rank * 7919 + world_size)
    while True:
        yield mean * (0.5 + rng.random())


def wait_commit(store: Store, step: int, attempt: str, world_size: int, timeout: float, rank: int = 0) -> None:
    """Poll for the commit record of ``step`` (above 1024 ranks, for the commit notice of this
    rank's group: ``donetree.notice_keys``); CheckpointError after ``timeout`` seconds, naming
    how many ranks finished. Paced by :func:`poll_delays`: the ranks polling one key together
    stay near ``POLLS_PER_SECOND`` existence checks (an S3 prefix serves ~5500)."""
    deadline = time.monotonic() + timeout
    notices = donetree.notice_keys(step, attempt, world_size)
    # Above 1024 ranks a rank polls its group's notice, paced for the group, and each poll is
    # of commit.json itself with probability NOTICE_GROUP / N (in case the committer died
    # before the notices): commit.json's prefix then sees about POLLS_PER_SECOND in all. A
    # random choice, not every k-th poll: ranks that finished together would poll in step.
    notice = notices[min(rank // donetree.NOTICE_GROUP, len(notices) - 1)] if notices else None
    delays = poll_delays(donetree.NOTICE_GROUP if notice else world_size, rank)
    pick = random.Random(rank * 104729 + step)
    if world_size > PACED_ABOVE:  # it has just found the done tree incomplete: no commit yet, and
        time.sleep(next(delays))  # thousands of ranks finishing together must not HEAD at once
    while True:
        if notice is None or pick.random() < donetree.NOTICE_GROUP / world_size:
            rec = catalog.read_commit(store, step)  # one GET: exists, and by whom
            if rec is not None:
                if rec.get("attempt") != attempt:
                    raise CheckpointError(
                        f"{catalog.where(store, step)}: committed by attempt {rec.get('attempt')!r}, not {attempt}"
                    )
                return
        elif store.exists(notice):  # under _done/<attempt>/: only this attempt's committer writes it
            return
        if time.monotonic() > deadline:
            n = donetree.count_done(store, step, attempt)
            raise CheckpointError(
                f"{catalog.where(store, step)}: not committed after {timeout:.0f} s: {n} of {world_size} ranks finished"
            )
        time.sleep(next(delays))


def check_consistency(store: Store, step: int, manifest: mf.Manifest) -> list[str]:
    """What ``ckptd verify`` checks of the commit protocol on a committed step: the commit
    record, the manifest, the newest claim (where the step has claims: checkpoints written
    before claims existed have none) and the done records all name one attempt."""
    where = catalog.where(store, step)
    errors = []
    rec = catalog.read_commit(store, step) or {}
    attempt = rec.get("attempt")
    if manifest.attempt and attempt != manifest.attempt:
        errors.append(f"{where}: commit.json names attempt {attempt!r} but manifest.json {manifest.attempt!r}")
    cs = claims(store, step)
    if cs and cs[-1][1].get("attempt") != attempt:
        errors.append(
            f"{where}: commit.json names attempt {attempt!r} but the step is claimed by "
            f"{cs[-1][1].get('writer')!r} attempt {cs[-1][1].get('attempt')!r}"
        )
    ws = rec.get("world_size")
    if attempt is not None and isinstance(ws, int):
        n = donetree.count_done(store, step, attempt)
        if n != ws:
            errors.append(f"{where}: {n} done records for attempt {attempt!r}, world size {ws}")
    return errors


__all__ = [
    "PACED_ABOVE",
    "POLLS_PER_SECOND",
    "check_consistency",
    "climb",
    "commit_step",
    "expected_digest",
    "expected_shards",
    "finish_rank",
    "held_whole",
    "newest_held",
    "poll_delays",
    "wait_commit",
    "whole_step",
]
