"""Plan records of ``ckptd reshard`` and the rechunked copies they point to.

::

    <job root>/
      step_0000000100/                      the checkpoint (never changed by reshard)
      _plans/step_0000000100_to_3.json      the plan for a restart of step 100 at 3 ranks
      _rechunked/to_3_fsdp/                 a job root of its own (``ckptd ls/verify`` work on it)
        step_0000000100/                    the same step, re-chunked for 3 FSDP ranks

Both live outside every ``step_*`` folder, so ``ckptd ls``, ``gc`` and ``latest_step`` of the job
root do not see them. A rechunked copy keeps the step number of the checkpoint it copies (the
training step it holds) in a separate job root, rather than taking a new step number in the
job root, which would make it the latest checkpoint for every world size and shift the step a
resumed job continues from.

A restore at world size M that asks for no particular step calls :func:`planned_source`: when
the plan of (latest step, M) has ``use_step`` and its copy is committed, the tensors and the
state tree are read from the copy (each rank reads whole chunks only); the RNG states stay in
the original's done records. A plan without ``use_step``, or one whose copy is gone, changes
nothing. ``ckptd gc URI/_rechunked/to_3_fsdp --keep-last 1`` prunes old copies.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

from ckptd import manifest as mf
from ckptd.errors import CheckpointError
from ckptd.reshard import ReadPlan, TargetLayout
from ckptd.sampler_math import SamplerResume
from storage_backends import NotFoundError, StorageError, Store, open_store

__all__ = [
    "PLAN_FORMAT",
    "PLAN_VERSION",
    "RECHUNKED",
    "make_record",
    "plan_key",
    "planned_source",
    "read_plan",
    "rechunked_root",
    "sub_uri",
    "write_plan",
]

log = logging.getLogger("ckptd.plans")

PLAN_FORMAT = "ckptd-reshard-plan"
PLAN_VERSION = 1
RECHUNKED = "_rechunked"
# What a plan may name as a copy: one folder under _rechunked/. The plan comes from the bucket;
# a restore must never follow it anywhere else (``../other-job``, an absolute path).
_ROOT_RE = re.compile(r"^_rechunked/[A-Za-z0-9_.-]+$")


def plan_key(step: int, world_size: int) -> str:
    return f"{mf.PLANS}/{mf.step_dir(step)}_to_{world_size}.json"


def rechunked_root(target: TargetLayout) -> str:
    """The copy's job root, relative to the job root."""
    return f"{RECHUNKED}/{target.slug}"


def sub_uri(store: Store, rel: str) -> str:
    """The URI of a folder inside a job root (a path, ``s3://``, ``memory://`` alike)."""
    return f"{store.uri.rstrip('/')}/{rel}"


def make_record(
    m: mf.Manifest,
    target: TargetLayout,
    plan: ReadPlan,
    resumes: list[SamplerResume],
    rechunked: dict | None = None,
) -> dict[str, Any]:
    """The plan record (also what ``ckptd reshard --json`` prints). ``rechunked``: ``root``
    (relative), ``uri``, ``step`` and ``reads`` (a ReadPlan's JSON against the copy)."""
    rec: dict[str, Any] = {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "step": m.step,
        "checkpoint_path": mf.step_dir(m.step),
        "saved_world_size": m.world_size,
        "world_size": target.world_size,
        "layout": target.to_json(),
        "tensors": len(m.tensors),
        "bytes": m.nbytes,
        "reads": plan.to_json(),
        "data_position": {
            "world_size_independent": True,
            "samplers": [r.to_json() for r in resumes],
        },
        "rechunked": rechunked,
        "created": time.time(),
    }
    if rechunked is not None:
        rec["use_step"] = rechunked["step"]
        rec["use_root"] = rechunked["root"]
    return rec


def write_plan(store: Store, record: dict) -> str:
    """Write (or replace) the plan of (step, world size); returns its key."""
    key = plan_key(record["step"], record["world_size"])
    store.put(key, json.dumps(record, indent=1, allow_nan=False).encode())
    return key


def read_plan(store: Store, step: int, world_size: int) -> dict | None:
    """The plan of (step, world size), None if there is none. Raises CheckpointError on a
    record that is not a plan."""
    key = plan_key(step, world_size)
    where = sub_uri(store, key)
    try:
        rec = mf.read_json(store, key, where, "plan")
    except NotFoundError:
        return None
    if not isinstance(rec, dict) or rec.get("format") != PLAN_FORMAT:
        raise CheckpointError(f"{where}: not a ckptd reshard plan")
    if rec.get("step") != step or rec.get("world_size") != world_size:
        raise CheckpointError(f"{where}: plan is for step {rec.get('step')} at {rec.get('world_size')} ranks")
    return rec


def planned_source(store: Store, step: int, world_size: int) -> str | None:
    """The URI of the job root to read ``step`` from at ``world_size`` ranks, when a plan names a
    committed rechunked copy of it; None to read the checkpoint itself. A plan that is malformed
    or names a missing copy is ignored with a warning: a plan only ever speeds a restore up."""
    try:
        rec = read_plan(store, step, world_size)
    except CheckpointError as e:
        log.warning("ignoring reshard plan: %s", e)
        return None
    if rec is None or rec.get("use_step") is None:
        return None
    root, use_step = rec.get("use_root"), rec.get("use_step")
    where = sub_uri(store, plan_key(step, world_size))
    if not isinstance(root, str) or not _ROOT_RE.match(root) or ".." in root or use_step != step:
        log.warning("ignoring reshard plan %s: it names %r step %r, not a copy of step %d", where, root, use_step, step)
        return None
    uri = sub_uri(store, root)
    try:
        with open_store(uri) as sub:
            committed = sub.exists(f"{mf.step_dir(step)}/{mf.COMMIT}")
    except (StorageError, ValueError) as e:
        log.warning("ignoring reshard plan %s: cannot open %s (%s)", where, uri, e)
        return None
    if not committed:
        log.warning("ignoring reshard plan %s: its copy %s is not committed", where, f"{uri}/{mf.step_dir(step)}")
        return None
    return uri
