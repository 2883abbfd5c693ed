"""``Checkpointer``: save and restore a training job's state at any world size.

Concurrency contract: one training thread calls the public methods; a background writer thread
(or the ``ckptd serve`` daemon) persists snapshots. At most one save is in flight: a new
``save`` first waits for the previous one, so host memory holds one snapshot, never a pile.
Parameters may change the moment ``save`` returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckptd import catalog, claims, jsonenc, persist, retention
from ckptd import manifest as mf
from ckptd.daemon_conn import resolve
from ckptd.errors import CheckpointError, CheckpointNotFoundError, StepHeld
from storage_backends import StorageError, Store, open_store
from trainer_hooks import hostcopy, memsteps, rng
from trainer_hooks.coord import Coordinator
from trainer_hooks.flatten import flatten
from trainer_hooks.restore import restore
from trainer_hooks.sink import Sink
from trainer_hooks.snapshot import Planner, take
from trainer_hooks.writer import BackgroundWriter

log = logging.getLogger("ckptd")


class Checkpointer:
    """Saves and restores ``state`` dicts under one job root URI.

    ``daemon``: None persists from a background thread of this process; an address
    (``unix:///path/ckptd.sock``, ``http://host:port``; ``ckptd.daemon_conn``) or True (the
    address in ``CKPTD_DAEMON``, else the daemon's default socket) hands each snapshot to a running
    ``ckptd serve``, which persists and commits it even if this
    process dies right after ``save`` returned; ``restore`` then reads each shard from the nearest
    memory tier that holds the committed step (this node's daemon, its peers, then the job root;
    ``trainer_hooks.tiered``; ``tiered_restore=False``: always the job root). ``keep_last``:
    retention, applied after each commit by this job (rank 0's background thread; never deletes
    the newest committed checkpoint or one being written).
    ``incremental``: shards whose content (sha256) has not changed since this process's previous
    committed save are hard-linked (filesystem) or server-side copied (S3) instead of written
    again; each checkpoint stays complete and independently readable, and ``gc`` stays correct.
    ``process_group``: the group the small collectives of ``save``/``restore`` run on (they
    exchange CPU objects, so a gloo group); it must span every rank of the job, since ranks and
    the world size are the default group's. None: the default group when it is gloo, else a new
    gloo group made here (which makes the constructor collective). ``commit_timeout``: seconds a
    save waits, after this rank's data and done record are durable, for the other ranks and the
    commit record; past it the save's future fails with ``CheckpointError`` (the checkpoint stays
    partial, and a later commit by the others still completes it). With a daemon, it bounds the
    whole save from its hand-off: past it the client and the daemon both give the save up.
    ``save_timeout``: seconds one save may take in the background, from ``save`` to its future's
    outcome, time queued behind the previous save included (with a daemon, the smaller of it and
    ``commit_timeout`` bounds the save from its hand-off); the sweep and retention after a commit
    run off that path. A save whose storage does not answer fails its future within this bound
    and is abandoned (it never commits afterwards, and gives its claim on the step up, so another
    job takes the step at once); ``save`` itself never talks to storage.
    ``max_step_jump``: ``save`` refuses a step more than this past the newest committed step
    this Checkpointer restored or committed (a typo'd or corrupted step number would count as the
    newest for retention and push every real step out); default ``CKPTD_MAX_STEP_JUMP``, else
    1000000; None or 0: no bound. The daemon bounds hand-offs the same way (``--max-step-jump``).
    ``persist_every`` (with a daemon; default 1): only steps divisible by it persist to the job
    root, the others stay in the daemons' memory (their future resolves once this rank's daemon
    holds its part); ``restore`` with no step may pick one (``trainer_hooks.memsteps``,
    docs/reliability.md "Memory-only steps").
    ``job_id``: this job's writer identity, which claims every step it saves so that a second
    job writing the same root is refused instead of mixed (``ckptd.commit``). Default:
    ``TORCHELASTIC_RUN_ID`` or ``SLURM_JOB_ID`` when set (the same across restarts of the job,
    so a restarted job takes over its own unfinished step), else a uuid agreed across ranks.
    """

    def __init__(
        self,
        root_uri: str,
        daemon: str | bool | None = None,
        keep_last: int | None = None,
        *,
        process_group=None,
        commit_timeout: float = 1800.0,
        incremental: bool = False,
        save_timeout: float = 1800.0,
        job_id: str | None = None,
        tiered_restore: bool = True,
        max_step_jump: int | None = -1,
        persist_every: int = 1,
    ):
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
        daemon = resolve(daemon)
        if type(persist_every) is not int or persist_every < 1 or (persist_every > 1 and daemon is None):
            raise CheckpointError(
                f"persist_every must be an int >= 1, and > 1 only with a daemon; got {persist_every!r}"
            )
        self.persist_every = persist_every
        try:
            self.store: Store = open_store(root_uri)
        except (StorageError, ValueError) as e:
            raise CheckpointError(str(e)) from None
        self.root_uri = root_uri
        self.daemon = daemon
        self.keep_last = keep_last
        if not save_timeout > 0:
            raise CheckpointError(f"save_timeout must be > 0, got {save_timeout}")
        self.coord = Coordinator(process_group)
        self.rank, self.world_size = self.coord.rank, self.coord.world_size
        self.job_id = claims.check_writer(self.coord.broadcast(job_id or _default_job_id()))
        self._committed_steps: set[int] = set()  # saved and committed by this Checkpointer
        if max_step_jump == -1:
            max_step_jump = retention.max_step_jump_default()
        if max_step_jump is not None and max_step_jump < 0:
            raise CheckpointError(f"max_step_jump must be >= 0 or None, got {max_step_jump}")
        self.max_step_jump = max_step_jump or None
        # The newest committed step this Checkpointer knows of (restored, or committed by it):
        # the base of the max_step_jump bound, known without a storage call in save().
        self._newest_known: int | None = None
        self._io = ThreadPoolExecutor(int(os.environ.get("CKPTD_IO_THREADS", "16")), thread_name_prefix="ckptd-io")
        # The snapshot's copies (``hostcopy``): a pool of their own, never queued behind I/O.
        self._copier = ThreadPoolExecutor(hostcopy.COPIERS, thread_name_prefix="ckptd-copy")
        self._planner = Planner()
        self._inflight: tuple[int, Future] | None = None
        self._unreported: list[tuple[int, BaseException]] = []
        self._skipped_held = False  # a step another job's live claim held was skipped (``save``)
        self._closed = False
        self.last_save_blocked_s = 0.0
        self.last_save_phases: dict[str, float] = {}
        self.last_restore_skipped: list[tuple[int, str]] = []  # (step, why): restore(fallback=True)
        # Where snapshots go (the ``sink.Sink`` contract): this process's writer thread, or the
        # daemon, whose stager's buffers are shared memory it can read.
        self._sink: Sink
        if daemon is None:
            self._sink = BackgroundWriter(
                self.store,
                self._io,
                keep_last,
                commit_timeout,
                incremental,
                writer=self.job_id,
                save_timeout=save_timeout,
            )
        else:
            from trainer_hooks.daemon_sink import DaemonSink

            bound = min(commit_timeout, save_timeout)  # the client's and the daemon's deadline
            self._sink = DaemonSink(daemon, root_uri, self.rank, self.world_size, keep_last, bound)
            self._sink.writer = self.job_id
        self._retention = (
            ThreadPoolExecutor(1, thread_name_prefix="ckptd-retention")
            if daemon is not None and keep_last and self.rank == 0
            else None
        )
        self._sink.max_step_jump = self.max_step_jump  # the bound its retention after a commit counts with
        self._stager = self._sink.stager()
        # With a daemon, restores read each shard from the nearest memory tier that holds the
        # committed step (``trainer_hooks.tiered``); bytes per tier in ``last_restore_tiers``.
        self._tiers = None
        if daemon is not None and tiered_restore:
            from trainer_hooks.tiered import TieredRestore

            self._tiers = TieredRestore(daemon, root_uri)

    # ------------------------------------------------------------------------------ save

    def save(self, step: int, state: dict[str, Any]) -> Future:
        """Snapshot ``state`` at ``step`` and persist it in the background. Collective.

        Returns once the snapshot is in host memory; the future resolves when the checkpoint is
        committed and raises its error if it is not. Raises at once if the previous save failed
        and nobody looked at its future, so failures never pass silently -- with one exception:
        the first save refused because another job's live claim holds its step (``StepHeld``:
        a job requeued while the job it replaces still holds a lease) is skipped, with one
        WARNING naming ``ckptd fence``, and this save goes on. A second such refusal is a
        second writer still at work on the root: raised, as every other failure.
        """
        self._check_open()
        t0 = time.perf_counter()
        mf.step_dir(step)  # validates the step
        self._wait_inflight()
        t_wait = time.perf_counter()
        attempt = self._begin(step)
        t_begin = time.perf_counter()
        flat = flatten(state)
        t_flat = time.perf_counter()
        job, entries = take(flat, step, attempt, self.rank, self.world_size, self._stager, self._planner, self._copier)
        t_snap = time.perf_counter()
        job.done["rng"] = jsonenc.encode(rng.capture())
        if self.rank == 0:
            m = mf.Manifest(
                step=step,
                world_size=self.world_size,
                tensors=entries,
                state=flat.tree,
                attempt=attempt,
                layout={"world_size": self.world_size},
            )
            job.metadata += persist.manifest_objects(m)
        memory_only = self.persist_every > 1 and memsteps.memory_only_save(
            self._sink, self.coord, step, attempt, job, self.persist_every
        )
        inner = self._sink.submit_memory(job) if memory_only else self._sink.submit(job)
        fut = _SaveFuture.chain(inner, step)
        if self._retention is not None and not memory_only:
            # Retention is the job's, not a per-request daemon setting: rank 0 applies it after
            # each commit, on a thread of its own (never the training thread).
            fut.add_done_callback(self._retain_after)
        self._inflight = (step, fut)
        t1 = time.perf_counter()
        self.last_save_blocked_s = t1 - t0
        self.last_save_phases = {
            "wait_previous": t_wait - t0,  # the previous save's commit
            "begin": t_begin - t_wait,  # agreeing on the step and attempt
            "flatten": t_flat - t_begin,  # get_model/optimizer_state_dict
            "snapshot": t_snap - t_flat,  # the copies into the reusable buffers
            "describe": t1 - t_snap,  # RNG, manifest, handing the job to the writer
        }
        return fut

    def _begin(self, step: int) -> str:
        """Agree on the step, on earlier failures and on a fresh attempt id. Collective, and
        no storage call: claiming the step (and refusing it if committed, or written by another
        job) is the background writer's first act, so a stalled store never blocks training.

        Every rank raises the same error: an earlier save that failed on any rank (its future
        not looked at), or a step this Checkpointer already committed."""
        err = None
        cause = None
        if self._unreported:
            earlier, cause = self._unreported[0]
            self._unreported.clear()
            if isinstance(cause, StepHeld) and not self._skipped_held:
                self._skipped_held = True
                if self.rank == 0:
                    log.warning("step %d skipped, saving step %d instead: %s", earlier, step, cause)
            else:
                err = f"an earlier save (step {earlier}) failed: {cause}"
        elif step in self._committed_steps:
            err = f"{catalog.where(self.store, step)}: step {step} is already committed; refusing to overwrite"
        elif self.max_step_jump and self._newest_known is not None and step > self._newest_known + self.max_step_jump:
            err = (
                f"{catalog.where(self.store, step)}: step {step} is {step - self._newest_known} steps past the newest "
                f"committed step {self._newest_known}, more than max_step_jump={self.max_step_jump}; refusing it "
                "(pass a larger max_step_jump, or set CKPTD_MAX_STEP_JUMP, if the job numbers its steps that way)"
            )
        lo_hi = self.coord.all_max([step, -step, self.persist_every, -self.persist_every])
        if lo_hi[0] != -lo_hi[1]:
            err = err or f"ranks disagree on the step to save: from {-lo_hi[1]} to {lo_hi[0]}"
        if lo_hi[2] != -lo_hi[3]:  # the memory-only decision is collective (``memsteps``)
            err = err or f"ranks disagree on persist_every: from {-lo_hi[3]} to {lo_hi[2]}"
        msg = self.coord.agree(err)
        if msg is not None:
            raise CheckpointError(msg) from cause
        return self.coord.broadcast(uuid.uuid4().hex[:12])

    def _retain_after(self, fut: Future) -> None:
        if Future.exception(fut) is None:  # the base method: does not mark it as observed
            with contextlib.suppress(RuntimeError):  # closing: the next job's commit retains
                self._retention.submit(retention.apply_retention, self.store, self.keep_last, self.max_step_jump)

    def _raise_unreported(self) -> None:
        if self._unreported:
            step, exc = self._unreported[0]
            self._unreported.clear()
            raise CheckpointError(f"an earlier save (step {step}) failed: {exc}") from exc

    def _wait_inflight(self) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            step, fut = inflight
            exc = Future.exception(fut)  # waits; the base method does not mark it as observed
            if exc is None:
                self._committed_steps.add(step)
                self._newest_known = max(step, self._newest_known or step)
            elif not fut.observed:
                self._unreported.append((step, exc))

    def wait(self) -> None:
        """Block until every save started so far is committed; raise the first failure."""
        self._wait_inflight()
        self._raise_unreported()

    def wait_idle(self) -> None:
        """``wait``, then also let background retention finish (the in-process writer's, or rank
        0's after a daemon commit). For benchmarks and tests that must not overlap it."""
        self.wait()
        self._sink.idle()
        if self._retention is not None:
            self._retention.submit(lambda: None).result()

    # --------------------------------------------------------------------------- restore

    def restore(
        self,
        state: dict[str, Any],
        step: int | None = None,
        *,
        strict: bool = True,
        in_place: bool = False,
        fallback: bool = False,
        require: bool = False,
    ) -> int | None:
        """Restore ``state`` in place from ``step`` (the latest committed if None). Collective.

        Returns the restored step, or None if the job root has no committed checkpoint: rank 0
        then logs one WARNING naming the root (a mistyped root would otherwise start the job
        from scratch without a word), and ``require=True`` raises ``CheckpointNotFoundError``
        naming it on every rank instead, for jobs that must resume. On any
        error every rank raises ``CheckpointError`` and ``state`` is left as it was.
        Entries of the checkpoint that ``state`` lacks are not restored (``{"model": m}`` from a
        full training checkpoint); inside each entry given, ``strict=False`` skips keys present
        on only one side instead of failing. A parameter the saved optimizer kept no state for
        (never reached by the loss) gets none after the restore either.
        ``in_place=True`` reads straight into the state's tensors: no second copy of the state in
        memory and no new buffers to fault in, but a read that fails midway (I/O error, corrupt
        chunk) leaves tensors partly overwritten, as ``dcp.load`` does. Mismatched keys, shapes
        and dtypes are still refused before anything is read.
        ``fallback=True`` (with ``step=None``): the newest committed step that restores cleanly,
        skipping newer ones that ``ckptd verify`` recorded bad or whose manifest or chunks fail
        their checks; each skip is logged, and ``last_restore_skipped`` lists (step, why).
        Raises, naming each step and why, when there are committed steps but none restores.
        """
        self._check_open()
        self.wait()
        if fallback and step is not None:
            raise CheckpointError("restore: fallback=True picks the step itself; do not pass step")
        if self._tiers is not None:
            self._tiers.begin()
        got, self.last_restore_skipped = restore(
            self.store,
            self.coord,
            state,
            step,
            strict,
            self._io,
            in_place=in_place,
            fallback=fallback,
            tiers=self._tiers,
        )
        newest = max([got, *(s for s, _ in self.last_restore_skipped)]) if got is not None else None
        if self._tiers is not None and got is not None:  # drop the abandoned future's memory-only steps
            self._tiers.fence(got)
        self._know(got, newest)
        if got is None:  # every rank got the same answer from rank 0
            if require:
                raise CheckpointNotFoundError(
                    f"{self.root_uri}: no committed checkpoint to restore (restore(require=True)); "
                    "check the root, or resume without require to start from scratch"
                )
            if self.rank == 0:
                log.warning("restore: %s has no committed checkpoint; starting from scratch", self.root_uri)
        return got

    def _know(self, restored: int | None, newest: int | None) -> None:
        """After a restore of ``restored`` (``newest``: the newest committed step seen, skipped
        ones included): forget the steps this Checkpointer committed after the restored one
        (quarantined since, or bad and still committed: then the claim in storage refuses them),
        so a step quarantined since saves again; and raise the base of the max_step_jump bound."""
        if restored is not None:
            self._committed_steps = {s for s in self._committed_steps if s <= restored}
        if newest is not None:
            self._newest_known = max(newest, self._newest_known if self._newest_known is not None else newest)

    @property
    def last_restore_tiers(self) -> dict[str, int]:
        """Chunk bytes the last restore read from this node's daemon (``local``), from peer
        daemons (``peer``) and from the job root (``root``); {} without memory tiers."""
        return dict(self._tiers.last) if self._tiers is not None else {}

    def latest_step(self) -> int | None:
        try:
            return catalog.latest_step(self.store)
        except StorageError as e:
            raise CheckpointError(str(e)) from None

    # ----------------------------------------------------------------------------- close

    def close(self) -> None:
        """Wait for outstanding saves, then release buffers and threads."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._sink.shutdown()
            if self._retention is not None:
                self._retention.shutdown(wait=True)
            self._io.shutdown(wait=True)
            self._copier.shutdown(wait=True)
            self._stager.release()
            self.store.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("Checkpointer is closed")

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def staged_bytes(self) -> int:
        """Host memory held by reusable snapshot buffers."""
        return self._stager.nbytes


class _SaveFuture(Future):
    """The future ``save`` returns. It remembers whether the caller looked at the outcome, so a
    failure the caller already saw is not raised a second time by the next ``save``."""

    observed = False

    @classmethod
    def chain(cls, inner: Future, step: int) -> _SaveFuture:
        outer = cls()

        def done(f: Future) -> None:
            exc = f.exception()
            if exc is None:
                outer.set_result(f.result())
            else:
                if not isinstance(exc, StepHeld):  # (the next save says whether it skips it)
                    log.error("save of step %d failed: %s", step, exc)
                outer.set_exception(exc)

        inner.add_done_callback(done)
        return outer

    def result(self, timeout=None):
        self.observed = True
        return super().result(timeout)

    def exception(self, timeout=None):
        self.observed = True
        return super().exception(timeout)


def _default_job_id() -> str:
    """The job's id from its launcher (the same on every rank and across restarts of the job),
    else a new uuid (rank 0's is broadcast)."""
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(name, "").strip()
        if value and value.lower() != "none":
            return re.sub(r"[^A-Za-z0-9_.:@-]", "_", f"{name.split('_')[0].lower()}-{value}")[:128]
    return uuid.uuid4().hex


__all__ = ["Checkpointer", "CheckpointError", "CheckpointNotFoundError"]
