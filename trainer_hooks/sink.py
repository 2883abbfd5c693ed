"""The sink contract: where a ``Checkpointer`` sends the snapshots it takes.

Two sinks implement it: ``writer.BackgroundWriter`` (persists from a thread of this process)
and ``daemon_sink.DaemonSink`` (hands each snapshot to ``ckptd serve``). Order of calls, all
from the training thread of one rank:

1. ``stager()`` once, at construction: the ``Stager`` whose buffers every ``save`` fills (host
   memory for the in-process writer, files of a shared-memory lease for the daemon);
2. per save, after the snapshot is in those buffers: ``submit(job)``, which returns at once with
   a ``Future`` resolved (``SaveResult``) when the step is committed, or failed with a
   ``CheckpointError``. The caller submits the next job only after that future is done, so a
   sink never holds two snapshots of one rank;
3. ``idle()`` when a caller must not overlap background work (retention) that the sink runs
   after a commit;
4. ``shutdown()`` once, at close: waits for what the sink owns, then releases its threads.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol, runtime_checkable

from ckptd.savejob import SaveJob
from trainer_hooks.snapshot import Stager

__all__ = ["Sink"]


@runtime_checkable
class Sink(Protocol):
    def stager(self) -> Stager: ...

    def submit(self, job: SaveJob) -> Future: ...

    def idle(self) -> None: ...

    def shutdown(self) -> None: ...
