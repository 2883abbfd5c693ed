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

The Trainer's step budget continues from the restored global step. The data loader does not:
the Trainer decides which batches to skip (from a ``resume_from_checkpoint`` folder) before any
callback runs, so after a ckptd restore the epoch schedule starts over from its first batch.
Training that must see exactly the data an uninterrupted run would see saves at epoch
boundaries with ``train_sampling_strategy="sequential"``, or gives the restore a resumable
sampler through ``extra_state``. Do not also pass ``resume_from_checkpoint``.
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - an optional extra
    raise ImportError("trainer_hooks.hf needs transformers: pip install 'ckptd[hf]'") from None

from trainer_hooks._callback_common import CheckpointCallbackBase

__all__ = ["CkptdCallback", "PROGRESS_FIELDS", "TrainerStateAdapter"]

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

    def _save(self, state, model, optimizer, lr_scheduler) -> None:
        self._save_step(state.global_step, lambda: self.state(state, model, optimizer, lr_scheduler))

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self._due(state.global_step):
            self._save(state, model, optimizer, lr_scheduler)

    def on_train_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        try:
            self._finish(state.global_step, lambda: self.state(state, model, optimizer, lr_scheduler))
        finally:
            self._close()
