"""What the Lightning and Hugging Face callbacks share: options, opening the Checkpointer and
restoring, saving a step once, closing, and the elastic training loader whose length is a whole
epoch at this world size. Framework-free: :mod:`trainer_hooks.lightning` and
:mod:`trainer_hooks.hf` import their framework themselves and mix this class into its callback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from torch.utils.data import DataLoader

from ckptd.sampler_math import share
from trainer_hooks.checkpointer import Checkpointer
from trainer_hooks.sampler import ElasticSampler, StatefulLoader


def rank_batches(sampler: ElasticSampler, start: int, batch_size: int) -> list[int]:
    """Batches each rank of the sampler's world gets from global position ``start`` of the epoch."""
    n, world, drop = sampler.dataset_len, sampler.num_replicas, sampler.state_dict()["drop_last"]
    shares = (share(n, start, r, world, drop) for r in range(world))
    return [s // batch_size if drop else -(-s // batch_size) for s in shares]


def check_even(sampler: ElasticSampler, batch_size: int, who: str, fix: str) -> None:
    """Refuse a world size at which the rest of the sampler's epoch, or a whole one, gives the
    ranks different batch counts: the ranks of a DDP step wait for each other, so the one with a
    batch more would wait forever."""
    for start in sorted({sampler.position, 0}, reverse=True):
        counts = rank_batches(sampler, start, batch_size)
        if len(set(counts)) > 1:
            raise ValueError(
                f"{who}: {sampler.dataset_len - start} samples {'left ' if start else ''}of epoch "
                f"{sampler.epoch} give {sampler.num_replicas} ranks {counts} batches of {batch_size}; "
                f"DDP needs the same count on every rank: {fix}"
            )


class EpochLoader(StatefulLoader):
    """The elastic training loader the callbacks hand their trainer: a ``StatefulLoader`` (the
    sampler's position counts the batches the training loop received, whatever the workers
    prefetch) whose ``len`` is a whole epoch at this world size, as the trainers size epochs
    with it, and whose ``set_epoch`` selects the sampler's epoch."""

    def __init__(self, loader: DataLoader) -> None:
        super().__init__(loader)
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size

    def __len__(self) -> int:
        return rank_batches(self.sampler, 0, self.batch_size)[self.sampler.rank]

    def batches_left(self) -> int:
        """Batches this rank has left in the sampler's epoch, from its position."""
        return rank_batches(self.sampler, self.sampler.position, self.batch_size)[self.sampler.rank]

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


@dataclass(eq=False, repr=False)
class CheckpointCallbackBase:
    """The ckptd side of a trainer callback; the subclass says what ``state`` is and when."""

    root_uri: str
    every_n_steps: int = 100
    _: KW_ONLY
    daemon: str | None = None
    keep_last: int | None = None
    extra_state: dict[str, Any] | None = None
    restore: bool = True
    save_on_train_end: bool = True
    ckpt: Checkpointer | None = field(default=None, init=False)
    restored_step: int | None = field(default=None, init=False)
    last_saved: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {self.every_n_steps}")
        self.extra_state = dict(self.extra_state or {})

    def _open(self, state: Callable[[], dict[str, Any]]) -> None:
        """Open the Checkpointer and, if asked, restore the latest committed step into ``state()``."""
        self.ckpt = Checkpointer(self.root_uri, daemon=self.daemon, keep_last=self.keep_last)
        if self.restore:
            self.restored_step = self.ckpt.restore(state())
            self.last_saved = self.restored_step

    def _save_due(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        if step > 0 and step % self.every_n_steps == 0:
            self._save_step(step, state)

    def _save_step(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        """Save ``state()`` at ``step`` unless it is already saved (or no Checkpointer is open)."""
        if self.ckpt is None or step == self.last_saved:
            return
        self.ckpt.save(step, state())
        self.last_saved = step

    def _finish(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        """At the end of training: save the last step if asked and not yet saved, wait for commits."""
        if self.ckpt is None:
            return
        if self.save_on_train_end and step > 0:
            self._save_step(step, state)
        self.ckpt.wait()

    def _close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
            self.ckpt = None
