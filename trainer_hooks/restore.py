"""Restore at any world size: each rank plans and reads only the slices it owns.

The steps, on every rank (collective), are docs/architecture.md's "One restore, in order". The
invariant they keep: nothing is written into ``state`` until all ranks agree that every read
succeeded, and applying is all or nothing too (an error while applying -- torch refusing an
optimizer's groups, a user object's ``load_state_dict`` raising -- is a ``CheckpointError``
naming the entry, and every rank puts its state back), so a failed restore leaves ``state``
untouched everywhere. ``in_place=True`` trades that for half the memory: the reads go into the
state's own tensors.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ckptd import catalog, jsonenc, pins, plans
from ckptd import manifest as mf
from ckptd.dtypes import as_numpy
from ckptd.errors import CheckpointError, StateMismatchError
from ckptd.layout import plan_reads, shard_index
from ckptd.reader import CheckpointReader, ReadRequest
from storage_backends import StorageError, Store, open_store
from trainer_hooks import hostcopy, rng
from trainer_hooks.coord import ERRORS, Coordinator, from_rank0
from trainer_hooks.flatten import apply, flatten
from trainer_hooks.sharding import is_dtensor, local_tensor
from trainer_hooks.state_check import validate
from trainer_hooks.storage_swap import can_swap_memory, exchange, settle
from trainer_hooks.zero import local_optimizer

__all__ = ["pins_for", "restore"]

log = logging.getLogger("ckptd.restore")


def _load_manifest(store: Store, coord: Coordinator, step: int) -> mf.Manifest:
    """Rank 0 reads and checks the manifest of ``step`` and broadcasts it; every rank gets it.

    One GET per restore instead of two requests per rank on the checkpoint's prefix: at 4096
    ranks and more that burst is over what S3 serves on one prefix (5500 GET/s) and restores met
    SlowDowns in ``benchmarks.scale``. Rank 0's error is raised on every rank."""
    return from_rank0(coord, lambda: pins.load_manifest(store, step))


def pins_for(
    store: Store, m: mf.Manifest, step: int, where: str, pool: ThreadPoolExecutor, requests: list[ReadRequest]
) -> pins.Pins | None:
    """The pins of the done records of the ranks that wrote the shards this rank reads
    (``ckptd.pins``), found from the manifest's ``writers``: about N/M records for a rank of M
    restoring a save of N; every record where an entry has no ``writers``. None for a step
    committed before pins (``m.pinned`` is False), whose chunks are checked by their own
    crc32c only. The records are read in parallel on ``pool``."""
    if not m.pinned:
        return None
    ranks: set[int] = set()
    for req in requests:
        e = req.entry
        if e.value is not None or e.layout.nbytes == 0:
            continue
        for sr in plan_reads(e.layout, req.want):
            r = e.writer_of(shard_index(e.layout, sr.shard))
            if r is None:
                return pins.read_ranks(store, step, m.attempt, range(m.world_size), where, pool)
            ranks.add(r)
    return pins.read_ranks(store, step, m.attempt, ranks, where, pool)


def _planned_store(store: Store, coord: Coordinator, step: int) -> Store:
    """Where to read ``step`` from when the caller asked for no particular step: the rechunked
    copy that ``ckptd reshard --rechunk --to M`` recorded for this world size, else ``store``.

    Rank 0 reads the plan (``ckptd.plans.planned_source``) and every rank follows its answer.
    The copy holds the same step, tensors and state tree, in chunks that match this world
    size; ``latest_step`` and an explicit ``step`` never look at plans."""
    uri = from_rank0(
        coord,
        lambda: plans.planned_source(store, step, coord.world_size),
        fail=lambda e: log.warning("ignoring reshard plans: %s", e),
    )
    if uri is None:
        return store
    log.info("step %d at world size %d: reading the rechunked copy %s (reshard plan)", step, coord.world_size, uri)
    try:
        return open_store(uri)
    except (StorageError, ValueError) as e:
        raise CheckpointError(f"{uri}: cannot open the rechunked copy named by the reshard plan ({e})") from None


def _restore_step(
    store: Store,
    coord: Coordinator,
    state: dict[str, Any],
    step: int,
    *,
    strict: bool,
    pool: ThreadPoolExecutor,
    restore_rng: bool,
    in_place: bool,
    planned: bool,
) -> int:
    """Restore ``step`` from ``store`` (a job root, or a ``tiered.TierSource``: the tiers of one
    step, whose own reader reads each shard from the nearest tier); read from its reshard plan's
    copy when ``planned``."""
    src = _planned_store(store, coord, step) if planned else store
    where = catalog.where(src, step)
    err: CheckpointError | None = None
    loaded: dict[str, torch.Tensor] = {}
    m = saved = None
    # A fresh optimizer gets state (a zero-gradient step) when it is flattened; a failed restore
    # takes that away again, so the optimizer is left as the caller gave it.
    fresh = [
        local_optimizer(o)
        for o in state.values()
        if isinstance(o, torch.optim.Optimizer) and not local_optimizer(o).state
    ]
    reading = False  # whether this rank began to read chunks (into the state, with in_place)
    try:
        m = _load_manifest(src, coord, step)
        saved = m if src is store else _load_manifest(store, coord, step)  # its done records hold the RNG
        flat = flatten(state)
        keys = validate(m, flat, where, strict)
        requests, outs = [], {}
        keys = [k for k in keys if flat.holds(k)]  # another rank's partition of a ZeRO optimizer: not read here
        for k in keys:
            t = flat.tensors[k]
            sh = flat.sharding(k)
            live = local_tensor(t).detach()
            # with in_place, read straight into the state's own tensor where it can be
            direct = in_place and live.device.type == "cpu" and live.is_contiguous()
            out = live if direct else torch.empty(sh.local_box.shape, dtype=t.dtype)
            outs[k] = (live, out)
            requests.append(ReadRequest(m.tensors[k], sh.local_box, as_numpy(out)))
        pins = pins_for(src, m, step, where, pool, requests)
        # A tier store reads each shard from the nearest tier (every chunk checked against its
        # crc32c and the writers' pins as any read's).
        tiered = getattr(src, "reader", None)
        reader = tiered(mf.step_dir(step), pins) if tiered else CheckpointReader(src, mf.step_dir(step), pins=pins)
        reading = True
        # The fresh buffers' pages are faulted in ahead of the reader threads (``hostcopy``).
        with hostcopy.prefaulting([out for live, out in outs.values() if out is not live]):
            reader.read(requests, pool)
        for k in keys:
            t = flat.tensors[k]
            live, out = outs.pop(k)
            if in_place:
                if out is not live:
                    live.copy_(out)  # a GPU (or strided) tensor, from its host scratch buffer
                loaded[k] = t  # apply() copies it onto itself: torch skips a copy between aliases
                continue
            data = out.to(live.device)
            if is_dtensor(t):
                from torch.distributed.tensor import DTensor

                data = DTensor.from_local(
                    data, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
                )
            loaded[k] = data
    except CheckpointError as e:
        err = e
    except StorageError as e:
        err = CheckpointError(f"{where}: {e}")
    except _MALFORMED as e:  # a tampered manifest the checks above did not foresee
        err = CheckpointError(f"{where}: malformed checkpoint ({type(e).__name__}: {e})")
    finally:
        if src is not store:
            src.close()
    failure = coord.agree(None if err is None else (type(err).__name__, str(err)))
    if failure is None:
        failure, err = _apply_all_or_nothing(state, m, flat, loaded, strict, where, in_place, coord, pool)
    if failure is not None:
        for o in fresh:
            o.state.clear()
        cls, msg = failure
        if in_place:
            # Only a failure after reads began can have touched the state; every rank learns
            # whether any rank had begun (one more collective, on the failure path only).
            touched = bool(coord.all_max([1 if reading else 0])[0])
            if touched:
                msg += " (restore with in_place=True: tensors of the state may be partly overwritten)"
            else:
                msg += " (nothing was read: the state is unchanged)"
        raise ERRORS.get(cls, CheckpointError)(msg) from err
    if restore_rng:
        _restore_rng(store, saved, coord)
    log.info("restored %s at world size %d (saved at %d)", where, coord.world_size, saved.world_size)
    return step


MEMORY_ONLY, COMMITTED = "memory-only", "committed"


def _candidates(store: Store, coord: Coordinator, step: int | None, fallback: bool, tiers) -> list:
    """Rank 0 orders the steps a restore tries and every rank gets its list of (kind, step,
    memory-only choice): with ``step`` asked, that committed step; else
    the newest memory-only step the tiers hold whole when it is newer than the newest committed
    one (``trainer_hooks.memsteps.choose``), then the newest committed step, or with
    ``fallback`` every committed step, newest first. Rank 0's error is raised on every rank."""
    from trainer_hooks import memsteps

    def plan():
        try:
            if step is not None:
                order = [catalog.resolve_step(store, step)]
            elif fallback:
                order = list(reversed(catalog.committed_steps(store)))
            else:
                order = [s for s in [catalog.latest_step(store)] if s is not None]
        except StorageError as e:
            raise CheckpointError(str(e)) from None
        got = [(COMMITTED, s, None) for s in order]
        if tiers is not None and step is None:
            try:
                choice = memsteps.choose(tiers, order[0] if order else None)
            except (CheckpointError, StorageError) as e:
                log.warning("restore: not looking for memory-only steps: %s", e)
                choice = None
            if choice is not None:
                got.insert(0, (MEMORY_ONLY, choice[0], choice))
        return got

    return from_rank0(coord, plan)


def restore(
    store: Store,
    coord: Coordinator,
    state: dict[str, Any],
    step: int | None,
    strict: bool,
    pool: ThreadPoolExecutor,
    *,
    in_place: bool = False,
    fallback: bool = False,
    tiers: Any = None,
) -> tuple[int | None, list[tuple[int, str]]]:
    """Restore ``state`` from the first candidate step (``_candidates``) that restores; with
    ``fallback``, committed steps that ``ckptd verify`` recorded bad or that fail because the
    checkpoint is broken (manifest, chunk crc32c, a missing object, storage errors) are skipped.
    ``tiers`` (a ``tiered.TieredRestore``): each step is read through the memory tiers' store of
    it. A mismatch between the state and the checkpoint is the caller's and is raised at once; a
    memory-only step that does not restore falls through to the next candidate on every rank.
    Returns (the step restored, or None when the root has none; the committed steps skipped with
    why). Raises CheckpointError naming every skipped
    step when none restores (storage that is down must not make a job start again from step 0).
    With ``in_place`` the next try overwrites whatever a failed one wrote."""
    from ckptd import verify as _verify  # verdicts of ``ckptd verify``

    candidates = _candidates(store, coord, step, fallback, tiers)
    newest = next((s for kind, s, _ in candidates if kind == COMMITTED), None)
    skipped: list[tuple[int, str]] = []
    for kind, s, choice in candidates:
        if kind == COMMITTED and fallback:
            # Rank 0 reads the step's verdict only when its turn comes (a verdict is checked
            # against the step's commit record and manifest); every rank gets the same answer.
            bad: Any = None
            if coord.rank == 0:
                rec = _verify.read_record(store, s)
                bad = None if rec is None or rec["ok"] else "; ".join(rec["errors"][:1]) or "recorded bad"
            bad = coord.broadcast(bad)
            if bad is not None:
                skipped.append((s, f"ckptd verify recorded it bad: {bad}"))
                log.warning("restore: skipping step %d: ckptd verify recorded it bad (%s)", s, bad)
                continue
        src = store
        if tiers is not None and kind == MEMORY_ONLY:
            _, attempt, holders, commit, data = choice
            holders = {k: (v[0], list(v[1])) for k, v in holders.items()}
            src = tiers.memory_only_source(attempt, s, holders, commit, data)
        elif tiers is not None:
            src = tiers.source(store, coord, s)
        try:
            got = _restore_step(
                src,
                coord,
                state,
                s,
                strict=strict,
                pool=pool,
                restore_rng=True,
                in_place=in_place,
                planned=kind == COMMITTED and step is None and s == newest,
            )
        except StateMismatchError:
            raise
        except CheckpointError as e:
            if kind == MEMORY_ONLY:  # agreed on every rank: all go on to the committed steps
                log.warning("restore: memory-only step %d did not restore (%s); trying the committed steps", s, e)
                continue
            if not fallback:
                raise
            skipped.append((s, str(e)))
            log.warning("restore: skipping step %d: %s", s, e)
            continue
        finally:
            if src is not store:
                src.close()
        if tiers is not None:
            tiers.report(src, got)
        if skipped:
            log.warning("restored step %d after skipping newer steps %s", got, ", ".join(str(x) for x, _ in skipped))
        return got, skipped
    if skipped:  # never start a job from scratch because its checkpoints could not be read
        raise CheckpointError(
            f"{store.uri}: no committed checkpoint restores; skipped "
            + "; ".join(f"step {x}: {why}" for x, why in skipped)
        )
    return None, skipped


# What a hostile manifest can make Python raise past the explicit checks; mapped to CheckpointError.
_MALFORMED = (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError, OverflowError)


def _apply_all_or_nothing(state, m, flat, loaded, strict, where, in_place, coord, pool):
    """Apply the read values on every rank, or on none: ``(None, None)`` when all ranks
    applied, else ``(failure agreed on, this rank's error)`` with ``state`` as it was.

    The fresh buffers and the live tensors exchange contents first (``storage_swap``), so
    applying copies each tensor onto itself and undoing exchanges back; after a success
    ``storage_swap.settle`` gives each swapped tensor its own memory back. ``in_place`` reads
    went into the live tensors already; only the non-tensor state can be undone then."""
    swapped: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
    undo: list = []
    err: CheckpointError | None = None
    try:
        if not in_place:
            pairs = [(local_tensor(flat.tensors[k]).detach(), local_tensor(data)) for k, data in loaded.items()]
            # A storage that any of its tensors must copy into is copied into by all of them:
            # a copy into memory swapped away would be lost.
            copied = {_storage_ptr(live) for live, new in pairs if not can_swap_memory(live, new)}
            memories = [_storage_ptr(live) not in copied for live, _ in pairs]
            for (live, new), memory, k in zip(pairs, memories, list(loaded), strict=True):
                exchange(live, new, memory)
                swapped.append((live, new, memory))
                loaded[k] = flat.tensors[k]
        apply(state, m.state, loaded, strict, undo, where)
    except CheckpointError as e:
        err = e
    except _MALFORMED as e:  # a tampered manifest's state the checks did not foresee
        err = CheckpointError(f"{where}: malformed checkpoint state ({type(e).__name__}: {e})")
    failure = coord.agree(None if err is None else (type(err).__name__, str(err)))
    if failure is not None:
        for u in reversed(undo):
            u()
        for live, old, memory in reversed(swapped):
            exchange(live, old, memory)
    else:
        settle(swapped, pool)
    return failure, err


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _restore_rng(store: Store, m: mf.Manifest, coord: Coordinator) -> None:
    src = coord.rank if coord.rank < m.world_size else 0
    try:
        key = catalog.done_record_key(store, m.step, m.attempt, src)
        rec = mf.read_json(store, key, catalog.where(store, m.step), "done record")
        if not isinstance(rec, dict) or "rng" not in rec:
            return
        saved = jsonenc.decode(rec["rng"])
    except (StorageError, CheckpointError, *_MALFORMED) as e:
        log.warning("no RNG state restored: %s", e)
        return
    if coord.world_size == m.world_size or coord.rank < m.world_size:
        rng.restore(saved)
    else:
        rng.reseed(saved, coord.rank)
