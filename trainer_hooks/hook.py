"""``CheckpointHook``: periodic saves and a clean stop on preemption, for a hand-written loop.

SIGTERM and SIGUSR1 are what Slurm (``--signal``), Kubernetes (pod termination) and torchrun
send before they stop a job. The handler only sets a flag; at the next ``after_step`` all ranks
take the logical OR of their flags (one tiny all-reduce per step), so every rank saves the same
step even when only one rank got the signal, waits for the commit and exits with status 0.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from ckptd import manifest as mf
from ckptd.errors import CheckpointError
from trainer_hooks.checkpointer import Checkpointer
from trainer_hooks.coord import from_rank0

__all__ = ["CheckpointHook", "STOP_SIGNALS"]

log = logging.getLogger("ckptd.hook")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class CheckpointHook:
    """Every rank constructs it (on the main thread, where signal handlers can be installed),
    calls ``resume()`` once, ``after_step(step)`` after every optimizer step with the same
    ``step`` on every rank, and ``close()`` at the end; ``resume`` and ``after_step`` are
    collective. ``every_n_steps=N`` saves steps N-1, 2N-1, ... (after the N-th, 2N-th step of
    the job, counted from step 0), without waiting for the commit. A stop signal is acted on at
    the next ``after_step``: the time from signal to exit is at most one step plus one commit,
    which must fit the launcher's grace period (torchrun ``--shutdown-timeout``, 30 s by
    default; Kubernetes ``terminationGracePeriodSeconds``; Slurm ``--signal=...@SECONDS``).
    """

    def __init__(
        self,
        ckpt: Checkpointer,
        state: dict[str, Any],
        every_n_steps: int | None = 100,
        save_on_signal: bool = True,
        exit_code: int = 0,
        fallback: bool = False,
    ):
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 or None, got {every_n_steps}")
        self.ckpt = ckpt
        self.state = state
        self.every_n_steps = every_n_steps
        self.exit_code = exit_code
        self.fallback = fallback
        self.signalled: int | None = None
        self.last_saved: int | None = None
        # Whether after_step makes the per-step all-reduce: decided by the argument alone, so
        # every rank makes the same collectives even where handlers could not be installed.
        self._watch = save_on_signal
        self._previous: dict[int, Any] = {}
        self._skipped: set[int] = set()  # committed steps the fallback resume skipped as bad
        if save_on_signal:
            if threading.current_thread() is threading.main_thread():
                for sig in STOP_SIGNALS:
                    self._previous[sig] = signal.signal(sig, self._on_signal)
            else:
                log.warning("CheckpointHook created off the main thread: signals are not handled")

    def _on_signal(self, signum, frame) -> None:
        self.signalled = signum

    def resume(self, require: bool = False) -> int:
        """Restore the latest committed checkpoint if there is one; the step to start from.

        With none, rank 0 logs a WARNING naming the root and training starts at step 0;
        ``require=True`` raises ``CheckpointNotFoundError`` instead (``Checkpointer.restore``).

        With ``fallback=True`` a corrupt latest checkpoint does not stop the job: it resumes
        from the newest one that restores (``Checkpointer.restore(fallback=True)``). The bad
        steps after it stay committed until an operator quarantines them (``ckptd quarantine``);
        when the job reaches one that is still committed, the hook does not save over it (a
        save refuses to overwrite a committed step): it logs a warning naming the step and the
        command, and the next periodic save goes on. Once quarantined, the step is saved again
        as usual. So the runbook's order (fallback resume, then quarantine) works either way.

        A step that another job's live claim still holds (the job this one replaces, e.g.
        requeued under a new id, before its lease ran out) is skipped once, with a WARNING
        naming ``ckptd fence``; the next save goes on (``Checkpointer.save``)."""
        step = self.ckpt.restore(self.state, fallback=self.fallback, require=require)
        self._skipped = {s for s, _ in self.ckpt.last_restore_skipped} if self.fallback else set()
        if step is None:
            return 0
        self.last_saved = step
        return step + 1

    def stop_requested(self) -> bool:
        """Whether any rank got a stop signal (collective when the job has several ranks)."""
        flag = 1 if self.signalled is not None else 0
        return bool(self.ckpt.coord.all_max([flag])[0]) if self._watch else bool(flag)

    def after_step(self, step: int) -> None:
        """Call after each optimizer step, on every rank."""
        stop = self.stop_requested()
        due = self.every_n_steps is not None and (step + 1) % self.every_n_steps == 0
        if stop:
            log.warning("stop requested (signal): saving step %d and exiting", step)
            try:
                if self.last_saved != step and not self._over_bad_step(step):
                    self.ckpt.save(step, self.state)
                    self.ckpt.wait()
                    self.last_saved = step
                self.ckpt.wait()
            finally:
                self.close()  # the handlers go back even when the save failed
            raise SystemExit(self.exit_code)
        if due and not self._over_bad_step(step):
            self.ckpt.save(step, self.state)
            self.last_saved = step

    def _over_bad_step(self, step: int) -> bool:
        """Whether ``step`` is a bad step the fallback resume skipped and it is still committed
        (rank 0 looks, every rank gets its answer: all ranks skip the save or none)."""
        if step not in self._skipped:
            return False
        still = from_rank0(
            self.ckpt.coord,
            lambda: self.ckpt.store.exists(f"{mf.step_dir(step)}/{mf.COMMIT}"),
            fail=lambda e: f"cannot check step {step} ({e})",
        )
        if isinstance(still, str):
            raise CheckpointError(still)
        if not still:
            self._skipped.discard(step)  # quarantined meanwhile: save it as usual
            return False
        log.warning(
            "not saving step %d: it is committed but did not restore when the job resumed (%s); "
            "retire it with `ckptd quarantine %s --step %d` so the job can save that step again",
            step,
            dict(self.ckpt.last_restore_skipped).get(step, "skipped by fallback"),
            self.ckpt.root_uri,
            step,
        )
        return True

    def close(self) -> None:
        """Wait for the last save and put the previous signal handlers back."""
        try:
            self.ckpt.wait()
        finally:
            for sig, handler in self._previous.items():
                # None: the previous handler was not installed from Python; the default is the
                # closest we can put back (signal.signal refuses None)
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
            self._previous.clear()
