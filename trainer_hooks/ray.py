"""Ray Train: ckptd inside a ``TorchTrainer``'s ``train_loop_per_worker`` (``pip install 'ckptd[ray]'``).

Inside the loop, ``Checkpointer``, ``CheckpointHook`` and ``ElasticSampler`` work unchanged: Ray
Train has set up ``torch.distributed`` (gloo or nccl) before the loop runs, and they take rank
and world size from it. What this module adds is the bookkeeping on Ray's side:
``RayCheckpointHook`` reports each *committed* ckptd step to Ray Train (``ray.train.report``
with a small checkpoint, a folder holding ``ckptd.json`` = ``{"root": ..., "step": ...}``), so
``Result.checkpoint``, ``CheckpointConfig(num_to_keep=...)`` and Ray's checkpoint history know
it; the tensors stay in ckptd's root and are never copied to Ray's storage::

    def train_loop_per_worker(config):
        sampler = ElasticSampler(len(dataset), seed=0)
        state = {"model": model, "optim": optim, "sampler": sampler}
        hook = RayCheckpointHook(Checkpointer(config["root"]), state, every_n_steps=100)
        start = hook.resume()                 # the latest committed step, at this num_workers
        for step in range(start, total):
            ...
            hook.after_step(step, metrics={"loss": loss})
        hook.close()                          # reports the last committed step

    trainer = TorchTrainer(train_loop_per_worker, train_loop_config={"root": "s3://b/run"},
                           scaling_config=ScalingConfig(num_workers=(2, 4)))   # elastic
    result = trainer.fit()
    root, step = ckptd_step(result.checkpoint)

A restarted trainer (a new ``fit``, or Ray's own restart after a worker failure, at whatever
``num_workers`` it gets) resumes from ckptd's latest committed step through ``hook.resume()``,
resharded for the new size; the data position comes from the ``ElasticSampler`` in the state.

When a step is reported: ``ray.train.report`` must be called by every worker the same number of
times, so the report must not depend on when each rank's future happens to resolve. A save of
step N returns before N is committed, and the next save first waits for N's commit on every rank;
so each ``after_step`` that saves reports the *previous* saved step, and ``close()`` (or a stop,
which waits for its commit) reports the last one. Rank 0 passes the checkpoint folder, the
others report the same metrics without one. Signals: Ray runs the loop off the main thread, where
no handler can be installed, so ``save_on_signal`` is off; Ray stops the loop itself.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

try:
    import ray.train
except ImportError:  # pragma: no cover - an optional extra
    raise ImportError("trainer_hooks.ray needs Ray Train: pip install 'ckptd[ray]'") from None

from ckptd import manifest as mf
from ckptd.errors import CheckpointError
from storage_backends import NotFoundError, open_store
from trainer_hooks.checkpointer import Checkpointer
from trainer_hooks.hook import CheckpointHook

__all__ = ["CKPTD_CHECKPOINT_FILE", "RayCheckpointHook", "ckptd_step", "report_committed"]

CKPTD_CHECKPOINT_FILE = "ckptd.json"


def report_committed(ckpt: Checkpointer, step: int, metrics: dict[str, Any] | None = None) -> None:
    """Report the committed ckptd ``step`` to Ray Train; call it on every worker (collective).
    The metrics get ``ckptd_step``; rank 0's report carries the pointer checkpoint."""
    metrics = {**(metrics or {}), "ckptd_step": step}
    if ckpt.rank != 0:
        ray.train.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory(prefix="ckptd-ray-") as d:
        (Path(d) / CKPTD_CHECKPOINT_FILE).write_text(json.dumps({"root": ckpt.root_uri, "step": step}))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def ckptd_step(checkpoint: ray.train.Checkpoint | None) -> tuple[str, int] | None:
    """``(root, step)`` from a checkpoint that ``report_committed`` made; None for None."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d, open_store(d) as store:
        try:  # capped and without links, as every record ckptd reads from storage
            record = mf.read_json(store, CKPTD_CHECKPOINT_FILE, d, "Ray checkpoint pointer", limit=64 * 1024)
        except NotFoundError:
            raise CheckpointError(f"{d}: no {CKPTD_CHECKPOINT_FILE} (not a checkpoint report_committed made)") from None
    if not isinstance(record, dict) or not isinstance(record.get("root"), str) or not mf.is_count(record.get("step")):
        raise CheckpointError(f"{d}: {CKPTD_CHECKPOINT_FILE} is not a ckptd pointer")
    return record["root"], record["step"]


class RayCheckpointHook(CheckpointHook):
    """``CheckpointHook`` that reports each committed step to Ray Train (see the module
    docstring for when). Construct, ``resume``, ``after_step`` and ``close`` on every worker."""

    def __init__(self, ckpt: Checkpointer, state: dict[str, Any], every_n_steps: int | None = 100):
        super().__init__(ckpt, state, every_n_steps=every_n_steps, save_on_signal=False)
        self.last_reported: int | None = None
        self._metrics: dict[str, Any] = {}

    def resume(self) -> int:
        start = super().resume()
        self.last_reported = self.last_saved  # already known to Ray, or from another run
        return start

    def after_step(self, step: int, metrics: dict[str, Any] | None = None) -> None:
        previous = self.last_saved
        super().after_step(step)
        if self.last_saved != previous and previous is not None and previous != self.last_reported:
            # save(step) has waited for `previous` to commit, on every rank
            self._report(previous)
        self._metrics = dict(metrics or {})

    def save_now(self, step: int) -> None:
        """Save ``step``, wait for its commit and report it (for a loop that stops itself)."""
        previous = self.last_saved
        if previous != step:
            self.ckpt.save(step, self.state)  # waits for `previous` to commit first
            self.last_saved = step
            if previous is not None and previous != self.last_reported:
                self._report(previous)
        self.ckpt.wait()
        self._report(step)

    def close(self) -> None:
        """Wait for the last save's commit, report it."""
        super().close()
        if self.last_saved is not None and self.last_saved != self.last_reported:
            self._report(self.last_saved)

    def _report(self, step: int) -> None:
        report_committed(self.ckpt, step, self._metrics)
        self.last_reported = step
