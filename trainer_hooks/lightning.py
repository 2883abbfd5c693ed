"""A Lightning ``Callback`` that saves through :class:`~trainer_hooks.Checkpointer` every N
optimizer steps and restores the latest committed checkpoint when fitting starts, at any world
size (``pip install 'ckptd[lightning]'``; ``lightning.pytorch`` or the older
``pytorch_lightning``); its ``loader`` is training data that resumes exactly once::

    cb = CkptdCallback("s3://bucket/job", every_n_steps=500)
    trainer = lightning.pytorch.Trainer(strategy="ddp", callbacks=[cb], ...)
    trainer.fit(model, cb.loader(dataset, batch_size=8, seed=0, num_workers=2))  # resumes, if a step is committed

What is saved: the LightningModule (``model``), its optimizers (``optim``; ``optim_1``, ... if
several), their LR schedulers (``sched``, ...), Lightning's fit-loop progress (``loops``: epoch,
global step, batch position and a resumable training loader's state, as Lightning's own
checkpoints keep them) and ``extra_state`` (objects with ``state_dict``/``load_state_dict``).
Modules go through ``torch.distributed.checkpoint.state_dict``, so DDP and FSDP strategies save
FQN-keyed, sharded state that restores at any other world size.

**The data.** Lightning restores its batch counter but starts the epoch's data over; ``loader``
owns the position instead (an ``ElasticSampler`` behind a ``StatefulLoader``, built at the
Trainer's data-parallel rank and size when Lightning first sizes it, and resumable in Lightning's
sense). How a resumed epoch ends on its last batch at any world size, and what is refused:
docs/interop.md, "Lightning: exactly once across a world-size change".

Order of hooks, on every rank (saves and restores are collective): ``setup`` keeps the Trainer
(the loader's ranks come from it); ``on_fit_start`` opens the Checkpointer and restores (after
the strategy has wrapped the model and built the optimizers, before the fit loop runs -- where
Lightning restores its own ``ckpt_path``); ``on_train_start`` checks the data and aligns the batch
counter; ``on_train_batch_end`` saves when ``trainer.global_step`` reaches a multiple of
``every_n_steps``; ``on_train_end`` saves the last step if it was not saved and waits for the
commit; ``teardown`` closes. Do not also pass ``ckpt_path`` to ``fit``: two restores would fight.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover - the older package name
    try:
        from pytorch_lightning import Callback
    except ImportError:
        raise ImportError(
            "trainer_hooks.lightning needs Lightning: pip install 'ckptd[lightning]' (lightning or pytorch_lightning)"
        ) from None

from torch.utils.data import DataLoader, Dataset

from trainer_hooks._callback_common import CheckpointCallbackBase, EpochLoader, check_even
from trainer_hooks.sampler import ElasticSampler

__all__ = ["CkptdCallback"]


def _named(prefix: str, objs: list) -> dict[str, Any]:
    return {prefix if i == 0 else f"{prefix}_{i}": o for i, o in enumerate(objs)}


class _TrainLoader:
    """What :meth:`CkptdCallback.loader` returns: the ``EpochLoader`` it stands for, built the
    first time Lightning sizes or iterates it (the ranks are known then)."""

    def __init__(self, callback: CkptdCallback, dataset: Dataset, options: dict[str, Any], kwargs: dict[str, Any]):
        self._callback, self.dataset, self._options, self._kwargs = callback, dataset, options, kwargs

    @cached_property
    def built(self) -> EpochLoader:
        return self._callback._build(self.dataset, dict(self._options), self._kwargs)

    @property
    def sampler(self) -> ElasticSampler:
        return self.built.sampler

    def __len__(self) -> int:
        return len(self.built)

    def __iter__(self):
        return iter(self.built)

    # Lightning's protocol for a resumable loader: it saves this with its fit-loop progress and
    # loads it back after building the loader, before iterating it
    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


_COUNTERS = ("ready", "started", "processed", "completed")


class CkptdCallback(CheckpointCallbackBase, Callback):
    _trainer: Any = None

    def state(self, trainer, pl_module) -> dict[str, Any]:
        """What is saved and restored (the names are the checkpoint's state keys)."""
        state: dict[str, Any] = {"model": pl_module}
        state.update(_named("optim", list(trainer.optimizers)))
        state.update(_named("sched", [cfg.scheduler for cfg in trainer.lr_scheduler_configs]))
        state["loops"] = trainer.fit_loop
        state.update(self.extra_state)
        return state

    def loader(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        **loader_kwargs: Any,
    ) -> _TrainLoader:
        """The training data for ``trainer.fit``, resumed exactly once at any world size (the
        module docstring says how): ``DataLoader(dataset, batch_size, drop_last=...,
        **loader_kwargs)`` dealt by an ``ElasticSampler(len(dataset), shuffle, seed, drop_last)``
        at the Trainer's data-parallel rank. Call it before ``fit`` or from ``train_dataloader``."""
        options = {"batch_size": batch_size, "shuffle": shuffle, "seed": seed, "drop_last": drop_last}
        return _TrainLoader(self, dataset, options, loader_kwargs)

    def _build(self, dataset: Dataset, options: dict[str, Any], kwargs: dict[str, Any]) -> EpochLoader:
        if self._trainer is None:
            raise RuntimeError("CkptdCallback.loader: use it inside trainer.fit, with the callback in the Trainer")
        ranks = self._trainer.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        batch_size = options.pop("batch_size")
        sampler = ElasticSampler(len(dataset), **options, rank=ranks["rank"], num_replicas=ranks["num_replicas"])
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=options["drop_last"], **kwargs)
        return EpochLoader(loader)

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer = trainer

    def on_fit_start(self, trainer, pl_module) -> None:
        self._open(lambda: self.state(trainer, pl_module))

    def on_train_start(self, trainer, pl_module) -> None:
        data = trainer.train_dataloader
        ours = data.built if isinstance(data, _TrainLoader) else None
        if ours is not None:
            check_even(ours.sampler, ours.batch_size, "CkptdCallback", "pass drop_last=True to its loader")
        progress = trainer.fit_loop.epoch_loop.batch_progress
        if self.restored_step is None or not progress.current.ready or progress.is_last_batch:
            return  # nothing restored mid-epoch
        if ours is None or ours.sampler.position == 0:
            why = "it holds no position of this loader" if ours else "Lightning would start that epoch's data over"
            raise RuntimeError(
                f"CkptdCallback: step {self.restored_step} was saved after batch {progress.current.ready} of "
                f"epoch {trainer.current_epoch}, and {why}: its first batches would be trained again and others "
                "never; train on CkptdCallback.loader(...) from the start of the job or of an epoch"
            )
        # Lightning counts the epoch's batches at the world size that trained them; the epoch ends
        # when the count reaches len(loader), a whole epoch at this world size
        shift = len(ours) - ours.batches_left() - progress.current.ready
        for counter in _COUNTERS:
            setattr(progress.current, counter, getattr(progress.current, counter) + shift)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._save_due(trainer.global_step, lambda: self.state(trainer, pl_module))

    def on_train_end(self, trainer, pl_module) -> None:
        self._finish(trainer.global_step, lambda: self.state(trainer, pl_module))

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._close()
