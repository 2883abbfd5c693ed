"""Retiring a bad checkpoint: ``quarantine`` moves a committed step out of the job root's step
folders, keeping every byte for inspection; ``unquarantine`` puts it back.

::

    <job root>/_quarantine/step_0000000300.20261130T201500Z-1a2b/
        quarantine.json      step, reason, time, the commit record it had, objects, bytes
        commit.json, manifest.json, arrays/...   the step's objects, names unchanged

Order (the store has no rename; on S3 a "move" is copy + delete): copy every object of the step
into its quarantine folder, write ``quarantine.json`` there, delete the step's ``commit.json``
(from here on the step is no longer committed: ``latest_step`` and restore skip it), then delete
the rest of the step folder. A kill at any point leaves either the step still committed (run it
again: a second copy is made) or a partial step folder that ``gc`` or the next save of that step
removes; never a committed step with holes. Afterwards the job can save that step number again.

``unquarantine`` copies the objects back and writes ``commit.json`` last, with
``put_if_absent``. Nothing reads ``_quarantine/``: it is not a step folder.
"""

from __future__ import annotations

import secrets
import time

from ckptd import catalog
from ckptd import manifest as mf
from ckptd.errors import CheckpointError, CheckpointNotFoundError
from storage_backends import NotFoundError, StorageError, Store

__all__ = ["FOLDER", "RECORD", "list_quarantined", "quarantine", "unquarantine"]

FOLDER = "_quarantine"
RECORD = "quarantine.json"


def quarantine(store: Store, step: int, reason: str = "") -> dict:
    """Retire committed ``step``; returns the quarantine record (with ``id``, its folder name)."""
    folder = mf.step_dir(step)
    where = catalog.where(store, step)
    try:
        if not store.exists(f"{folder}/{mf.COMMIT}"):
            raise CheckpointNotFoundError(f"{where}: not committed; nothing to quarantine")
        try:
            commit = mf.read_json(store, f"{folder}/{mf.COMMIT}", where, "commit record")
        except CheckpointError:
            commit = None  # a corrupt commit record is a fine reason to quarantine
        name = f"{folder}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(2)}"
        dest = f"{FOLDER}/{name}/"
        objects = list(store.list(f"{folder}/"))
        for info in objects:
            store.copy(info.key, dest + info.key[len(folder) + 1 :])
        record = {
            "id": name,
            "step": step,
            "reason": reason,
            "time": time.time(),
            "commit": commit,
            "objects": len(objects),
            "bytes": sum(o.size for o in objects),
        }
        store.put(dest + RECORD, mf.dumps(record))
        store.delete(f"{folder}/{mf.COMMIT}")  # from here on the step is not committed
        store.purge(f"{folder}/")
    except StorageError as e:
        raise CheckpointError(f"{where}: quarantine failed: {e}") from None
    return record


def list_quarantined(store: Store) -> list[dict]:
    """Every quarantine record of the root, oldest first."""
    try:
        _, names = store.list_dir(f"{FOLDER}/")
    except StorageError as e:
        raise CheckpointError(f"{store.uri}: cannot list {FOLDER}/ ({e})") from None
    out = []
    for name in names:
        try:
            rec = mf.read_json(store, f"{FOLDER}/{name}/{RECORD}", store.uri, "quarantine record")
            if not isinstance(rec, dict):
                raise CheckpointError("not an object")
        except (NotFoundError, CheckpointError):
            rec = {"id": name, "step": mf.parse_step_dir(name.split(".", 1)[0]), "incomplete": True}
        out.append(rec | {"id": name})
    return sorted(out, key=lambda r: r["id"].split(".", 1)[-1])


def saved_since(store: Store, step: int, since: float) -> list[int]:
    """Committed steps numbered ``step`` or later whose commit record is younger than ``since``
    (a wall-clock time): evidence that the job's history moved past ``step`` after it was
    quarantined, so its number was, or may have been, saved again (and perhaps gc'd since)."""
    out = []
    for s in catalog.committed_steps(store):
        if s < step:
            continue
        try:
            commit = catalog.read_commit(store, s)
        except CheckpointError:
            out.append(s)  # an unreadable commit record proves nothing either way: count it
            continue
        t = commit.get("time") if commit is not None else None
        if commit is not None and (isinstance(t, bool) or not isinstance(t, int | float) or t > since):
            out.append(s)
    return out


def unquarantine(store: Store, step: int, qid: str | None = None, force: bool = False) -> dict:
    """Put back the newest quarantined copy of ``step`` (or the one named ``qid``).

    Refused when the step folder holds anything, and (unless ``force``) when a step numbered
    ``step`` or later was committed after the quarantine (:func:`saved_since`): the old copy
    would restore a checkpoint from a history the job left. Its ``_verify.json`` comes back too."""
    folder = mf.step_dir(step)
    where = catalog.where(store, step)
    candidates = [r for r in list_quarantined(store) if r.get("step") == step and not r.get("incomplete")]
    if qid is not None:
        candidates = [r for r in candidates if r["id"] == qid]
    if not candidates:
        raise CheckpointNotFoundError(f"{where}: no quarantined copy" + (f" named {qid!r}" if qid else ""))
    rec = candidates[-1]
    src = f"{FOLDER}/{rec['id']}/"
    try:
        if any(True for _ in store.list(f"{folder}/")):
            raise CheckpointError(
                f"{where}: the step folder is not empty (step {step} was saved again, or a save is "
                "running); quarantine or delete that checkpoint first"
            )
        qtime = rec.get("time")
        if not force:
            if isinstance(qtime, bool) or not isinstance(qtime, int | float):
                raise CheckpointError(
                    f"{where}: the quarantine record of {rec['id']} has no time; pass --force to put it back"
                )
            if later := saved_since(store, step, qtime):
                raise CheckpointError(
                    f"{where}: steps {', '.join(map(str, later[:5]))} were committed after {rec['id']} "
                    f"was quarantined, so step {step} was (or may have been) saved again since; refusing to put "
                    "the old copy back (--force to do it anyway)"
                )
        objects = [o for o in store.list(src) if o.key[len(src) :] not in (RECORD, mf.COMMIT)]
        for info in objects:
            store.copy(info.key, f"{folder}/{info.key[len(src) :]}")
        # the record put back is read capped and must parse, as every reader of it will
        record = store.get(src + mf.COMMIT, limit=mf.MAX_RECORD_BYTES)
        if not isinstance(mf.loads(record, where, "quarantined commit record"), dict):
            raise CheckpointError(f"{where}: the quarantined commit record is not a JSON object")
        if not store.put_if_absent(f"{folder}/{mf.COMMIT}", record):
            raise CheckpointError(f"{where}: committed by someone else meanwhile; the quarantined copy stays")
        store.purge(src)
    except NotFoundError as e:
        raise CheckpointError(f"{where}: the quarantined copy {rec['id']} is incomplete ({e})") from None
    except StorageError as e:
        raise CheckpointError(f"{where}: unquarantine failed: {e}") from None
    return rec
