"""A Hugging Face ``transformers.TrainerCallback`` that saves through
:class:`~trainer_hooks.Checkpointer` every N optimizer steps and restores the latest committed
checkpoint when training begins, at any world size (``pip install 'ckptd[hf]'``)::

    trainer = transformers.Trainer(model, args, train_dataset=ds,
                                   callbacks=[CkptdCallback("s3://bucket/job", every_n_steps=500)])
    trainer.train()                 # resumes from the latest committed step, if any

What is saved: the model (``model``), the optimizer (``optim``) and LR scheduler (``sched``),
unwrapped from accelerate's wrappers, the progress fields of ``TrainerState`` (``trainer_state``:
global step, epoch, tokens seen, FLOs, log history, best metric) and ``extra_state``. Modules go
through ``torch.distributed.checkpoint.state_dict``, so DDP and FSDP runs save FQN-keyed,
sharded state that restores at any other world size.

Order of events, on every rank (saves and restores are collective): ``on_train_begin`` opens
the Checkpointer and restores (the model is wrapped and the optimizer and scheduler exist by
then); ``on_step_end`` saves when ``state.global_step`` reaches a multiple of ``every_n_steps``;
``on_train_end`` saves the last step if it was not saved, waits for the commit and closes.

A stock ``Trainer`` sizes its epochs and decides which batches to skip before any callback runs,
so after a restore mid-epoch it would start the epoch's data over from its first batch: the
callback refuses such a step at ``on_train_begin`` (steps saved at an epoch's end resume).
:class:`ElasticTrainer` is the Trainer whose data continues too, at any world size. Do not
also pass ``resume_from_checkpoint``.
"""

from __future__ import annotations

import importlib
import math
from functools import partial
from typing import Any

try:
    from transformers import Trainer, TrainerCallback, TrainerState
    from transformers.trainer_utils import has_length, seed_worker
    from transformers.utils import is_datasets_available
except ImportError:  # pragma: no cover - an optional extra
    raise ImportError("trainer_hooks.hf needs transformers: pip install 'ckptd[hf]'") from None

from torch.utils.data import DataLoader, IterableDataset

from trainer_hooks._callback_common import CheckpointCallbackBase, EpochLoader, check_even, rank_batches
from trainer_hooks.checkpointer import Checkpointer
from trainer_hooks.sampler import ElasticSampler

__all__ = ["CkptdCallback", "ElasticTrainer", "PROGRESS_FIELDS", "TrainerStateAdapter"]

# TrainerState fields that describe progress (the rest is this run's configuration).
PROGRESS_FIELDS = (
    "global_step",
    "epoch",
    "num_input_tokens_seen",
    "total_flos",
    "log_history",
    "best_metric",
    "best_global_step",
)


class TrainerStateAdapter:
    """``state_dict``/``load_state_dict`` over the progress fields of a ``TrainerState``."""

    def __init__(self, state):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {f: getattr(self.state, f) for f in PROGRESS_FIELDS if hasattr(self.state, f)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        for f, v in d.items():
            if f in PROGRESS_FIELDS:
                setattr(self.state, f, v)


def _unwrap(obj):
    """accelerate's AcceleratedOptimizer/AcceleratedScheduler keep the real one as an attribute."""
    for attr in ("optimizer", "scheduler"):
        inner = getattr(obj, attr, None)
        if inner is not None and type(inner).__module__.split(".")[0] == "torch":
            return inner
    return obj


class CkptdCallback(CheckpointCallbackBase, TrainerCallback):
    def state(self, trainer_state, model, optimizer, lr_scheduler) -> dict[str, Any]:
        """What is saved and restored (the names are the checkpoint's state keys)."""
        state: dict[str, Any] = {"model": model}
        if optimizer is not None:
            state["optim"] = _unwrap(optimizer)
        if lr_scheduler is not None:
            state["sched"] = _unwrap(lr_scheduler)
        state["trainer_state"] = TrainerStateAdapter(trainer_state)
        state.update(self.extra_state)
        return state

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        self._open(lambda: self.state(state, model, optimizer, lr_scheduler))
        if self.restored_step is not None and state.epoch % 1:
            self._close()
            raise RuntimeError(
                f"CkptdCallback: step {self.restored_step} was saved at epoch {state.epoch:.3f}, and this Trainer "
                "starts that epoch's data over from its first batch (repeating those, never reaching others); "
                "train with trainer_hooks.hf.ElasticTrainer"
            )

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        self._save_due(state.global_step, lambda: self.state(state, model, optimizer, lr_scheduler))

    def on_train_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        try:
            self._finish(state.global_step, lambda: self.state(state, model, optimizer, lr_scheduler))
        finally:
            self._close()


# ------------------------------------------------------------------------------ ElasticTrainer

# The Trainer internals ElasticTrainer hooks into (transformers 5.x); checked when it is built, so
# another layout fails with one clear error instead of silently restarting the epoch.
_HOOKS = {
    "_run_epoch": ("epoch", "train_dataloader", "steps_in_epoch", "num_update_steps_per_epoch"),
    "_init_training_state": (),
    "set_initial_training_values": (),
    "_get_collator_with_removed_columns": (),
    "_remove_unused_columns": (),
}


def _check_trainer_layout() -> None:
    import inspect

    import transformers

    for name, params in _HOOKS.items():
        fn = getattr(Trainer, name, None)
        if fn is None or not set(params) <= set(inspect.signature(fn).parameters):
            raise RuntimeError(
                f"ElasticTrainer hooks Trainer.{name}({', '.join(params)}), which transformers "
                f"{transformers.__version__} lacks; it is tested with transformers 5.24"
            )


def _start_epoch(sampler: ElasticSampler, batch_size: int) -> None:
    """Right after the restore: move past an epoch that has no batch left, and refuse a world size
    at which the ranks' batch counts differ (``check_even``)."""
    if rank_batches(sampler, sampler.position, batch_size)[sampler.rank] == 0:
        sampler.set_epoch(sampler.epoch + 1)  # the saved epoch was done: the next one
    check_even(sampler, batch_size, "ElasticTrainer", "dataloader_drop_last=True")


class _ElasticCallback(CkptdCallback):
    """ElasticTrainer's ckptd side. The sampler and the trainer's progress are restored first,
    by :meth:`restore_data` from ``get_train_dataloader`` (before the Trainer sizes its epochs);
    model, optimizer, scheduler and ``extra_state`` at ``on_train_begin`` (once they exist), from
    the same step. Saves hold all of it, sampler included."""

    sampler: ElasticSampler | None = None
    progress: dict[str, Any] | None = None

    def restore_data(self, sampler: ElasticSampler) -> None:
        if self.ckpt is None:
            self.ckpt = Checkpointer(self.root_uri, daemon=self.daemon, keep_last=self.keep_last)
        self.sampler = sampler
        self.restored_step = self.progress = None
        if not self.restore:
            return
        progress = TrainerStateAdapter(TrainerState())
        self.restored_step = self.ckpt.restore({"sampler": sampler, "trainer_state": progress})
        self.last_saved = self.restored_step
        if self.restored_step is not None:
            self.progress = progress.state_dict()

    def state(self, trainer_state, model, optimizer, lr_scheduler) -> dict[str, Any]:
        state = super().state(trainer_state, model, optimizer, lr_scheduler)
        state["sampler"] = self.sampler
        return state

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self.ckpt is None or self.sampler is None:
            raise RuntimeError("ElasticTrainer: training began without its get_train_dataloader")
        if self.restored_step is not None:
            rest = self.state(state, model, optimizer, lr_scheduler)
            del rest["sampler"], rest["trainer_state"]  # restored before the Trainer sized its epochs
            self.ckpt.restore(rest, step=self.restored_step)


class ElasticTrainer(Trainer):
    """A ``transformers.Trainer`` that checkpoints through ckptd and resumes exactly once across a
    change of world size::

        trainer = ElasticTrainer(model=model, args=args, train_dataset=ds,
                                 ckptd_root="s3://bucket/job", ckptd_every_n_steps=500)
        trainer.train()          # resumes from the latest committed step of the root, if any

    **Data.** The training loader deals each epoch with an :class:`~trainer_hooks.ElasticSampler`
    through a ``StatefulLoader`` and is *not* given to ``accelerator.prepare``, whose sharding
    would split the sampler's per-rank share again (batches reach the device through the
    Trainer's own ``_prepare_inputs``). The sampler's position is saved with every checkpoint.

    **Order of events** (every rank): ``get_train_dataloader`` opens the Checkpointer and restores
    the sampler and the progress fields of ``TrainerState`` from the latest committed step (an
    epoch that was finished moves on to the next); the Trainer then sizes its epochs from them:
    the first one is the rest of the resumed epoch, the others whole. ``on_train_begin`` restores
    model, optimizer, scheduler and ``ckptd_extra_state`` from the same step. Every
    ``ckptd_every_n_steps`` optimizer steps, and at the end, it saves through ckptd.

    The step budget, what holds across a change of world size and what is refused (with why):
    docs/interop.md, "Hugging Face Trainer: exactly once across a world-size change". The
    Trainer internals it hooks (``_HOOKS``) are verified when it is built.

    ``trainer.ckptd`` is its callback: ``restored_step`` (None on a fresh root) and, during
    ``train()``, ``ckpt``, the open :class:`~trainer_hooks.Checkpointer`.
    """

    def __init__(
        self,
        *args: Any,
        ckptd_root: str,
        ckptd_every_n_steps: int = 100,
        ckptd_daemon: str | None = None,
        ckptd_keep_last: int | None = None,
        ckptd_extra_state: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        _check_trainer_layout()
        super().__init__(*args, **kwargs)
        args_ = self.args
        if args_.train_sampling_strategy not in ("random", "sequential"):
            raise ValueError(
                f"ElasticTrainer: train_sampling_strategy={args_.train_sampling_strategy!r} orders samples by "
                "batch and world size, so a saved position means nothing at another size; use 'random' or 'sequential'"
            )
        acc = args_.accelerator_config
        for flag in ("split_batches", "dispatch_batches"):
            if getattr(acc, flag, None):
                raise ValueError(f"ElasticTrainer: accelerator_config.{flag}=True would re-deal the elastic sampler")
        self.ckptd = _ElasticCallback(
            ckptd_root,
            ckptd_every_n_steps,
            daemon=ckptd_daemon,
            keep_last=ckptd_keep_last,
            extra_state=ckptd_extra_state,
        )
        # first, so that the other callbacks' on_train_begin see the restored state
        self.callback_handler.callbacks.insert(0, self.ckptd)

    def train(self, resume_from_checkpoint=None, *args: Any, **kwargs: Any):
        if resume_from_checkpoint not in (None, False):
            raise ValueError(
                "ElasticTrainer resumes from its ckptd root; resume_from_checkpoint would load another "
                "checkpoint over it and skip batches by the old world size"
            )
        return super().train(None, *args, **kwargs)

    def get_train_dataloader(self) -> EpochLoader:
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if isinstance(dataset, IterableDataset) or not has_length(dataset):
            raise ValueError("ElasticTrainer needs a map-style train_dataset with a length (ElasticSampler)")
        collator = self.data_collator
        if is_datasets_available() and isinstance(dataset, importlib.import_module("datasets").Dataset):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        args = self.args
        rank, world = args.process_index, args.world_size
        sampler = ElasticSampler(
            len(dataset),
            shuffle=args.train_sampling_strategy == "random",
            seed=args.data_seed if args.data_seed is not None else args.seed,
            drop_last=args.dataloader_drop_last,
            rank=rank,
            num_replicas=world,
        )
        batch = self._train_batch_size
        try:
            self.ckptd.restore_data(sampler)
            _start_epoch(sampler, batch)
        except BaseException:
            self.ckptd._close()  # training does not start: on_train_end will not close it
            raise
        loader = DataLoader(
            dataset,
            batch_size=batch,
            sampler=sampler,
            collate_fn=collator,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers,
            multiprocessing_context=args.dataloader_multiprocessing_context,
            prefetch_factor=args.dataloader_prefetch_factor,
            drop_last=args.dataloader_drop_last,
            worker_init_fn=partial(seed_worker, num_workers=args.dataloader_num_workers, rank=rank),
        )
        return EpochLoader(loader)

    def set_initial_training_values(self, args, dataloader):
        values = list(super().set_initial_training_values(args, dataloader))
        if not isinstance(dataloader, EpochLoader):
            return tuple(values)
        # (num_train_epochs, num_update_steps_per_epoch, ..., max_steps): the epoch loop runs
        # range(resumed epoch, num_train_epochs), and the first one is the resumed epoch's rest
        per_epoch, accumulate = values[1], args.gradient_accumulation_steps
        epoch = dataloader.sampler.epoch
        if args.max_steps > 0:  # the flow callback stops at max_steps; enough epochs to get there
            values[0] = epoch + 1 + math.ceil(args.max_steps / per_epoch)
        else:
            epochs = math.ceil(args.num_train_epochs)
            done = (self.ckptd.progress or {}).get("global_step", 0)
            left = 0
            if epoch < epochs:
                left = math.ceil(dataloader.batches_left() / accumulate) + (epochs - epoch - 1) * per_epoch
            values[0], values[-1] = epochs, done + left
        return tuple(values)

    def _init_training_state(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        epochs_trained, skip = super()._init_training_state(*args, **kwargs)
        sampler = self.ckptd.sampler
        if sampler is None:
            return epochs_trained, skip
        if self.ckptd.progress is not None:
            TrainerStateAdapter(self.state).load_state_dict(self.ckptd.progress)
        return sampler.epoch, 0  # nothing to skip: the sampler starts at its position

    def _run_epoch(self, **kwargs: Any):
        if self.state.global_step >= self.state.max_steps:
            self.control.should_training_stop = True  # a restored job that had already finished
            return None
        loader = kwargs["train_dataloader"]
        if isinstance(loader, EpochLoader) and kwargs["epoch"] == loader.sampler.epoch:
            # the resumed epoch: its rest, so the last accumulation and the epoch's end fall right
            left = loader.batches_left()
            kwargs["steps_in_epoch"] = left
            kwargs["num_update_steps_per_epoch"] = max(1, math.ceil(left / self.args.gradient_accumulation_steps))
        return super()._run_epoch(**kwargs)
